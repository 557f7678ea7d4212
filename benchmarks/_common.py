"""What every benchmark records beside its numbers: device, clocks, versions, command."""

from __future__ import annotations

import datetime as dt
import json
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
_CLOCK_KEYS = ("driver", "nvml")


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def device_info(device: torch.device) -> dict[str, object]:
    import triton

    from minengine.ops import flashinfer_ref

    info: dict[str, object] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "flashinfer": flashinfer_ref.version(),
        "python": platform.python_version(),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        info["sm_count"] = torch.cuda.get_device_properties(device).multi_processor_count
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
            info["driver"] = pynvml.nvmlSystemGetDriverVersion()
            for key, clock in (("sm", pynvml.NVML_CLOCK_SM), ("mem", pynvml.NVML_CLOCK_MEM)):
                info[f"clock_{key}_mhz"] = pynvml.nvmlDeviceGetClockInfo(handle, clock)
                info[f"clock_{key}_max_mhz"] = pynvml.nvmlDeviceGetMaxClockInfo(handle, clock)
        except Exception as exc:  # nvidia-ml-py missing or no NVML: record why
            info["nvml"] = f"unavailable: {exc}"
    return info


def header(title: str, report: dict) -> list[str]:
    """Markdown lines: title, command, date, versions, clocks."""
    info = report["info"]
    versions = ("torch", "triton", "transformers", "flashinfer", "python")
    lines = [
        f"# {title}: {info['device']}",
        "",
        *(["**Smoke run: tiny shapes, timings meaningless.**", ""] if report["config"].get("smoke") else []),
        f"- command: `{report['command']}`",
        f"- date (UTC): {report['date']}",
        "- versions: " + ", ".join(f"{k} {info[k]}" for k in versions if k in info),
    ]
    clocks = ", ".join(f"{k} {v}" for k, v in info.items() if k.startswith("clock_") or k in ("driver", "nvml"))
    return lines + ([f"- clocks: {clocks}"] if clocks else [])


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M")


def command(argv: list[str] | None, script: str) -> str:
    return " ".join(["python", *sys.argv]) if argv is None else f"{script}.main({argv!r})"


def _plain(value):
    """A config value as JSON writes it: a path as its text, a set as a sorted list (the set of
    FlashInfer baselines whose build failed crashed the first GPU run's report)."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=str)
    return value


def report(argv: list[str] | None, script: str, device: torch.device, args, rows: list[dict], **extra) -> dict:
    """The JSON skeleton every benchmark writes: command, date, device info, config, rows."""
    config = {k: _plain(v) for k, v in vars(args).items() if k != "out"}
    return {
        "command": command(argv, script),
        "date": now(),
        "info": device_info(device),
        "config": config,
        **extra,
        "rows": rows,
    }


def stem(prefix: str, report: dict) -> str:
    """File name stem of a result: the prefix and the device, or ``<prefix>_smoke``. Only letters,
    digits, ``.``, ``-`` and ``_``: a CPU's name ("Intel(R) Xeon(R) Processor @ 2.50GHz") becomes
    ``Intel_R_Xeon_R_Processor_2.50GHz``, a name every shell and file transfer takes as it is."""
    if report["config"].get("smoke"):
        return f"{prefix}_smoke"
    return f"{prefix}_" + re.sub(r"[^A-Za-z0-9.-]+", "_", str(report["info"]["device"])).strip("_")


def save(out_dir: Path, stem: str, report: dict, markdown: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / f"{stem}.md").write_text(markdown)


def publish(out_dir: Path, prefix: str, report: dict, markdown: str) -> dict:
    """Save a finished report under its stem (``stem``) and print its markdown."""
    save(out_dir, stem(prefix, report), report, markdown)
    print(markdown)
    return report


def require_positive(parser, args, *names: str) -> None:
    """``parser.error`` unless every named option (a number, or the smallest of a list) is >= 1."""
    for name in names:
        value = getattr(args, name)
        least = min(value) if isinstance(value, list) else value
        if least < 1:
            parser.error(f"--{name.replace('_', '-')} {least}; allowed: 1 or more")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: torch.device, calls: int, repeats: int) -> float:
    """Median over ``repeats`` rounds of the ms per call of ``fn``."""
    rounds = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync(device)
        rounds.append((time.perf_counter() - start) / calls * 1e3)
    return statistics.median(rounds)


def summarize_spans(spans: list[tuple[float, float]], steps: int) -> dict | None:
    """From GPU activity intervals (microseconds) over ``steps`` steps: ``idle`` = 1 - busy/window
    (the window from the first start to the last end), ``busy_ms`` = GPU-busy time per step (the
    union of the intervals), ``kernels`` = intervals per step. None without intervals."""
    spans = sorted(spans)
    if not spans:
        return None
    busy, cur_start, cur_end = 0, *spans[0]
    for s, e in spans[1:]:
        if s > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = s, e
        else:
            cur_end = max(cur_end, e)
    busy += cur_end - cur_start
    window = max(e for _, e in spans) - spans[0][0]
    return {"idle": 1 - busy / window, "busy_ms": busy / steps / 1e3, "kernels": len(spans) / steps}
