"""``python -m minengine.serve``: the OpenAI-compatible server.

With no arguments it serves the built-in ``tiny`` model on 127.0.0.1:30000. Every engine config
field is a flag (``chunked_prefill_size`` is ``--chunked-prefill-size``), defaults in ``--help``.
The scheduler runs in its own process; SIGTERM or Ctrl-C shut both down within a few seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import errno
import logging
import os
import signal
import socket
import sys

import uvicorn

from minengine.config import CHOICES, EngineConfig
from minengine.server.access import add_access_control, add_access_flags, check_access_flags
from minengine.server.reasoning import PARSERS as REASONING_PARSERS
from minengine.server.tool_calls import PARSERS
from minengine.tokenizer import load_chat_template

logger = logging.getLogger("minengine.serve")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage dump
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="python -m minengine.serve",
        description="OpenAI-compatible server for minengine.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=30000, help="port to listen on (1..65535)")
    parser.add_argument("--served-model-name", default=None, help="model name in the API (default: --model)")
    parser.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    chat = parser.add_argument_group("chat API (as vLLM's flags)")
    chat.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE_OR_TEMPLATE",
        help="a Jinja chat template (a file, or the text) instead of the checkpoint's",
    )
    chat.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let a request bring its own chat_template (rendered sandboxed)",
    )
    chat.add_argument("--response-role", default="assistant", help="the answer's role when its turn is opened")
    chat.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help='logprobs name tokens "token_id:<id>" unless a request says otherwise',
    )
    chat.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='tool_choice "auto": tool calls are found in the output (needs --tool-call-parser)',
    )
    chat.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(PARSERS),
        help="the model's tool call format: hermes (Qwen2.5, Qwen3), llama3_json (Llama 3.1)",
    )
    chat.add_argument(
        "--reasoning-parser",
        default=None,
        choices=REASONING_PARSERS,
        help="split the <think> reasoning from the answer: qwen3 (Qwen3, QwQ), deepseek_r1 (R1 and its distills)",
    )
    parser.add_argument(
        "--torch-profiler-dir",
        default=None,
        metavar="DIR",
        help="where /start_profile writes its torch.profiler traces (default: none, profiling off)",
    )
    add_access_flags(parser)
    engine = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        kind = str(f.type)
        if kind == "bool":
            engine.add_argument(flag, action="store_true", help=f.name)
        elif f.name in CHOICES:
            engine.add_argument(flag, default=f.default, choices=CHOICES[f.name], help=f.name)
        else:
            typ = int if kind.startswith("int") else float if kind.startswith("float") else str
            engine.add_argument(flag, type=typ, default=f.default, metavar=typ.__name__.upper(), help=f.name)
    return parser


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, EngineConfig]:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 1 <= args.port <= 65535:
        parser.error(f"argument --port: {args.port} is out of range; allowed: 1..65535")
    if args.chat_template is not None:
        try:
            args.chat_template = load_chat_template(args.chat_template)
        except ValueError as exc:
            parser.error(f"argument --chat-template: {exc}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error(
            "argument --enable-auto-tool-choice: it needs --tool-call-parser (allowed: "
            + ", ".join(sorted(PARSERS))
            + ")"
        )
    check_access_flags(parser, args)
    if args.torch_profiler_dir is not None:
        args.torch_profiler_dir = os.path.abspath(args.torch_profiler_dir)  # (the workers' cwd may differ)
        try:
            os.makedirs(args.torch_profiler_dir, exist_ok=True)
        except OSError as exc:
            parser.error(f"argument --torch-profiler-dir: cannot make the folder: {exc}")
        if not os.access(args.torch_profiler_dir, os.W_OK | os.X_OK):
            parser.error(f"argument --torch-profiler-dir: {args.torch_profiler_dir!r} is not a writable folder")
    if not args.response_role.strip():
        parser.error(f"argument --response-role: {args.response_role!r} is empty; allowed: a role name")
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}
    try:
        config = EngineConfig.from_kwargs(**fields)
    except ValueError as exc:
        name = str(exc).split(" ", 1)[0]
        parser.error(f"argument --{name.replace('_', '-')}: {exc}")
    return args, config


class _Server(uvicorn.Server):
    """uvicorn with our start-up and shutdown. Start-up: the workers load the model and answer
    Ready before the port opens (a worker that fails ends the run with its one-line reason; a
    signal ends it, exit code 0). Shutdown, on SIGTERM / SIGINT: 503 for new requests, in-flight ones
    end (finished or ``abort``), then exit; a second signal exits at once. A scheduler that dies
    while serving (an error in a step, a killed process): its in-flight requests end with an error,
    and the server exits with its reason and code 1, as vLLM's and SGLang's do, so that whatever
    supervises it can start a new one instead of routing to a server that can only answer 500."""

    def __init__(self, config: uvicorn.Config, state, workers):
        super().__init__(config)
        self.state, self.workers = state, workers
        self.failed: str | None = None  # why start-up failed, or why a scheduler died while serving
        self.stopped_early = False  # a signal came while the workers started
        self.listen_failed: OSError | None = None  # the port, bound before the load, taken meanwhile

    async def serve(self, sockets=None) -> None:
        from minengine.server.api import _summary
        from minengine.server.frontend import SchedulerDied

        client = self.state.client
        loop = asyncio.get_running_loop()
        start = asyncio.ensure_future(self.workers.start())

        def stop_early() -> None:
            self.stopped_early = True
            start.cancel()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop_early)
        try:
            try:
                ready = await start
            except asyncio.CancelledError:
                if not self.stopped_early:
                    raise
            finally:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)
            if self.stopped_early:  # (also when the signal came as the workers answered)
                logger.info("stopped while the workers started")
                return
            logger.info(
                "serving %s on http://%s:%d (%d worker(s), context %d, KV capacity %d tokens each)",
                self.state.served_model_name,
                self.config.host,
                self.config.port,
                len(self.workers.processes),
                ready.context_length,
                ready.kv_capacity_tokens,
            )
            try:  # (another server may have bound the port too: both can, until one listens)
                for sock in sockets or ():
                    sock.listen(self.config.backlog)
            except OSError as exc:
                self.listen_failed = exc
                return
            watch = asyncio.ensure_future(self._exit_when_dead())
            try:
                await super().serve(sockets)
            finally:
                watch.cancel()
        except SchedulerDied as exc:
            self.failed = _summary(exc)
        finally:  # inside the event loop, where zmq.asyncio sockets must be closed
            client.shutdown()
            client.close()

    async def _exit_when_dead(self) -> None:
        from minengine.server.api import _summary
        from minengine.server.frontend import SchedulerDied

        client = self.state.client
        while client.dead is None:
            await asyncio.sleep(0.1)
        self.failed = _summary(SchedulerDied(client.dead))
        logger.error("exiting: the scheduler is gone")
        self.should_exit = True  # uvicorn: no new connections; open ones get up to 3 s to end

    @contextlib.contextmanager
    def capture_signals(self):
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal)
        try:
            yield
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    def _on_signal(self) -> None:
        if self.state.shutting_down:
            self.force_exit = True
            return
        logger.info("shutting down")
        asyncio.get_running_loop().create_task(self._graceful())

    async def _graceful(self) -> None:
        await self.state.begin_shutdown()
        self.should_exit = True


def _bind(host: str, port: int) -> list[socket.socket]:
    """The server's TCP sockets, one per address ``host`` resolves to (as asyncio's create_server,
    which uvicorn calls, makes them: IPv6 ones IPv6-only), bound and not yet listening: a
    connection is refused until they listen."""
    socks: list[socket.socket] = []
    missing: OSError | None = None  # as asyncio: an address of a family this machine lacks (::1) is skipped
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                if exc.errno != errno.EADDRNOTAVAIL:
                    raise
                missing = exc
                socks.pop().close()
                continue
            sock.set_inheritable(True)
        if not socks and missing is not None:  # none of them: the host is not this machine's
            raise missing
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks


def _bind_error(prog: str, host: str, port: int, exc: OSError) -> str:
    """One line naming the flag at fault: the port (in use, or privileged) or the host."""
    flag = "--port" if exc.errno in (errno.EADDRINUSE, errno.EACCES) else "--host"
    return f"{prog}: error: argument {flag}: cannot bind {host}:{port}: {exc}"


def run_server(args: argparse.Namespace, config: EngineConfig) -> int:
    import zmq

    from minengine.models import load_tokenizer, sampling_defaults
    from minengine.server.api import ServerState, build_app
    from minengine.server.metrics import Metrics
    from minengine.server.workers import Workers

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    prog = build_parser().prog
    source = config.tokenizer or config.model
    try:  # before any worker starts: a wrong path fails at once, and nothing is left behind
        tokenizer = load_tokenizer(source)
    except Exception as exc:  # no tokenizer.json, a malformed one, not a folder, ...
        flag = "--tokenizer" if config.tokenizer else "--model"
        print(f"{prog}: error: argument {flag}: cannot load a tokenizer from {source!r}: {exc}", file=sys.stderr)
        return 2
    try:  # bound now, so a port in use fails at once; it listens (opens) once the workers are ready
        socks = _bind(args.host, args.port)
    except OSError as exc:
        print(_bind_error(prog, args.host, args.port, exc), file=sys.stderr)
        return 2
    try:
        defaults = sampling_defaults(config.model, config.generation_config)
    except (OSError, ValueError) as exc:  # no model directory; a value in its generation_config.json
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    metrics = Metrics()
    try:
        workers = Workers(config, metrics)  # the schedulers load the model; the port opens once they are ready
    except (OSError, ValueError, zmq.ZMQError) as exc:  # no folder for its sockets, a process that cannot start
        for sock in socks:
            sock.close()
        print(f"{prog}: error: cannot start the scheduler workers: {exc}", file=sys.stderr)
        return 1
    name = args.served_model_name or config.model
    if args.chat_template is not None:
        tokenizer.chat_template = args.chat_template
    state = ServerState(
        workers.client,
        tokenizer,
        name,
        metrics,
        config.disaggregation_mode,
        config.disaggregation_bootstrap_port if config.disaggregation_mode == "prefill" else None,
        defaults,
        trust_request_chat_template=args.trust_request_chat_template,
        response_role=args.response_role,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        torch_profiler_dir=args.torch_profiler_dir,
    )

    app = build_app(state)
    add_access_control(app, args)
    server = _Server(
        uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=3),
        state,
        workers,
    )
    try:
        server.run(sockets=socks)
    finally:
        for sock in socks:
            sock.close()
        # a worker still loading the model reads no Shutdown: after a failed or stopped start-up,
        # no wait; a signal now (a second Ctrl-C) ends the wait without a traceback
        previous = {sig: signal.signal(sig, lambda *_: workers.hurry()) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            workers.stop(grace=5.0 if server.started else 0.0)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    if server.listen_failed is not None:
        print(_bind_error(prog, args.host, args.port, server.listen_failed), file=sys.stderr)
        return 2
    if server.failed is not None:
        print(f"{prog}: error: {server.failed}", file=sys.stderr)
        return 1
    return 0 if server.started or server.stopped_early else 1


def main(argv: list[str] | None = None) -> int:
    args, config = parse_args(argv)
    return run_server(args, config)


if __name__ == "__main__":
    sys.exit(main())
