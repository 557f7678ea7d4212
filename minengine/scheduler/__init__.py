"""Scheduling: the pure batch-building policy and the loop state that applies it."""

from minengine.scheduler.policy import Budget, RunningInfo, Schedule, WaitingInfo, build_schedule
from minengine.scheduler.scheduler import Scheduler

__all__ = ["Budget", "RunningInfo", "Schedule", "Scheduler", "WaitingInfo", "build_schedule"]
