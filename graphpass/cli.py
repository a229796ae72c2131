"""The ``graphpass`` command line: plan, launch and inspect without writing Python.

    graphpass plan configs:build --arg gpt3-175b --cluster h100-80g:128x8 --batch 1536x2048
                                      # plan a model built on the meta device; print the plan
                                      # (--strategy dp=8,tp=8,zero=1: price that one instead)
    graphpass run -n 4 train.py ARGS  # run a script on 4 local ranks through torchrun
    graphpass explain plan.json [--html plan.html]   # Plan.explain() of a saved plan (and its page)
    graphpass dumps DIR               # summary.txt and the collectives in each rank's final graph
    graphpass presets                 # the cluster presets and their figures
    graphpass profile --world-size 2  # measure this machine; Cluster.local(2) then loads it
    graphpass env                     # versions, backends, devices and profiles, for bug reports

Bad input exits with status 2 and one line saying what to change.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.util
import inspect
import io
import os
import pathlib
import platform
import re
import subprocess
import sys
import sysconfig
import traceback

from graphpass.cluster import Cluster, presets
from graphpass.planner import DEFAULT_MEMORY_FRACTION
from graphpass.plan import Plan, Strategy
from graphpass.progress import phase

# fx prints a call to graphpass.runtime.<module>.<op> as graphpass_runtime_<module>_<op>(...).
_COLLECTIVE_RE = re.compile(r"graphpass_runtime_(?:collectives|grad_sync|zero|tensor_parallel)_(\w+)\(")


def _presets(_: argparse.Namespace) -> int:
    for name in presets():
        cluster = Cluster.preset(name, nodes=1, gpus_per_node=8)
        device = cluster.device
        print(
            f"{name:10s} {device.memory_bytes / 2**30:6.1f} GiB  bf16 {device.peak_tflops.get('bf16', 0):6.1f} TFLOP/s  "
            f"HBM {device.memory_bandwidth_gbps:6.0f} GB/s  | {cluster.explain()}"
        )
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (``graphpass plan: error: ...``) and exit status 2."""

    def error(self, message: str):  # noqa: D102 - argparse's hook
        self.exit(2, f"{self.prog}: error: {message}\n")


class _Usage(Exception):
    """Bad input found after parsing: printed as one line, exit status 2."""


def _explain(args: argparse.Namespace) -> int:
    path = pathlib.Path(args.plan)
    if not path.is_file():
        raise _Usage(f"no such plan file {path}")
    try:
        plan = Plan.from_json(path.read_text())
    except (ValueError, TypeError) as exc:
        raise _Usage(f"{path} is not a saved plan: {exc}") from None
    html_path = _output_path(args.html, "--html")
    if html_path is not None:  # first: a reader who stops reading (`| head`) still gets it
        plan.to_html(html_path)
    print(plan.explain())
    if html_path is not None:
        print(f"page: {html_path.resolve()}")
    return 0


def _load_factory(spec: str):
    """``MODULE:FACTORY`` → the callable: MODULE is an importable dotted name or a ``.py`` path
    (its directory goes on ``sys.path``, so its own imports resolve); the working directory is
    searched first."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise _Usage(f"factory {spec!r} must be MODULE:FACTORY, e.g. configs:build or examples/configs.py:build")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        if module_name.endswith(".py") or os.sep in module_name:
            path = pathlib.Path(module_name).resolve()
            if not path.is_file():
                raise _Usage(f"no such module file {module_name}")
            sys.path.insert(0, str(path.parent))
            loader_spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[path.stem] = module
            loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except _Usage:
        raise
    except Exception as exc:  # ImportError, and whatever the module's own code raises on import
        raise _Usage(f"cannot import {module_name!r} for the factory {spec!r}: {_one_line(exc)}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise _Usage(f"module {module_name!r} has no factory {attr!r} (a callable returning the model)")
    return factory


def _one_line(exc: BaseException, with_type: bool = True) -> str:
    """``exc`` as one line: its type, its message's lines joined with ``; `` (a CaptureError lists
    one reason per capture route), and the line of the user's code that raised it."""
    lines = [line.strip().lstrip("- ") for line in str(exc).splitlines() if line.strip()]
    text = (lines[0] + " " + "; ".join(lines[1:])).strip() if lines else ""
    if with_type:
        text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    frame = _user_frame(exc)
    if frame is not None and " (at " not in text:
        text += f" (at {frame.filename}:{frame.lineno})"
    return text


def _user_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of ``exc``'s traceback outside Python, installed packages and graphpass."""
    library = [pathlib.Path(sysconfig.get_paths()[key]).resolve() for key in ("stdlib", "purelib", "platlib")]
    library += [pathlib.Path(path).resolve() for name in ("graphpass", "graphpass.passes", "graphpass.cost",
                                                          "graphpass.runtime") if name in sys.modules
                for path in getattr(sys.modules[name], "__path__", [])]
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        path = pathlib.Path(frame.filename).resolve()
        if frame.filename.startswith("<") or any(path.is_relative_to(root) for root in library):
            continue
        return frame
    return None


def _count(num: float) -> str:
    """A parameter count as people write it: 867K, 12.3M, 1.31B, 175B."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if num >= scale:
            return f"{num / scale:.3g}{suffix}"
    return f"{num:.0f}"


def _batch_shape(text: str) -> tuple[int, ...]:
    match = re.fullmatch(r"(\d+)(?:x(\d+))?", text.strip())
    if not match or int(match.group(1)) < 1 or (match.group(2) is not None and int(match.group(2)) < 1):
        raise _Usage(f"--batch {text!r} must be BATCHxSEQ (e.g. 512x2048) or BATCH")
    return tuple(int(g) for g in match.groups() if g is not None)


def _cluster(text: str) -> Cluster:
    """``--cluster``: a preset (``h100-80g``, ``h100-80g:16x8``), joined sites
    (``h100-80g:4x8+a100-80g:4x8@wan-10g``) or a cluster JSON file (what ``graphpass profile``
    writes, or ``Cluster.to_json``)."""
    from graphpass.planner import resolve_cluster

    path = pathlib.Path(text).expanduser()
    if "@" not in text and (text.endswith(".json") or os.sep in text or path.is_file()):
        if not path.is_file():
            raise _Usage(f"--cluster: no such cluster file {text} (give a preset such as h100-80g:16x8, or the "
                         "JSON graphpass profile --out writes)")
        try:
            return Cluster.from_json(path.read_text())
        except (ValueError, TypeError, KeyError, UnicodeDecodeError) as exc:  # json.JSONDecodeError is a ValueError
            raise _Usage(f"--cluster: {text} is not a cluster JSON (graphpass profile writes one): "
                         f"{_one_line(exc)}") from None
    try:
        return resolve_cluster(text)
    except (ValueError, KeyError) as exc:
        raise _Usage(f"--cluster: {str(exc).strip(chr(39))}") from None


def _strategy(text: str, world_size: int) -> Strategy:
    """``--strategy dp=8,tp=8,zero=1`` → a checked :class:`Strategy` for ``world_size`` devices; dp,
    when not given, takes the devices tp x pp leave."""
    fields = {f.name: f.default for f in dataclasses.fields(Strategy)}
    kwargs: dict[str, object] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = (part.strip() for part in item.partition("="))
        key = key.replace("-", "_")
        if key not in fields:
            raise _Usage(f"--strategy: unknown key {key!r} in {text!r}; the keys are {', '.join(fields)}")
        if not sep or not value:
            raise _Usage(f"--strategy: {key} needs a value ({key}=...)")
        if key in kwargs:
            raise _Usage(f"--strategy: {key} is given twice in {text!r}")
        default = fields[key]
        if isinstance(default, bool):
            truth = {word: True for word in ("true", "yes", "on", "1")} | {
                word: False for word in ("false", "no", "off", "0")}
            if value.lower() not in truth:
                raise _Usage(f"--strategy: {key}={value!r} must be true or false")
            kwargs[key] = truth[value.lower()]
        elif isinstance(default, int) or default is None:  # None: dp_shard's "all of dp"
            if not re.fullmatch(r"\d+", value):
                raise _Usage(f"--strategy: {key}={value!r} must be a whole number")
            kwargs[key] = int(value)
        else:
            kwargs[key] = value
    if not kwargs:
        raise _Usage(f"--strategy {text!r}: give KEY=VALUE pairs, e.g. dp=8,tp=8,zero=1")
    if "dp" not in kwargs:
        rest = int(kwargs.get("tp", 1)) * int(kwargs.get("pp", 1))
        if rest and world_size % rest == 0:
            kwargs["dp"] = world_size // rest
    try:
        strategy = Strategy(**kwargs)
        strategy.check(world_size)
    except (ValueError, NotImplementedError) as exc:
        raise _Usage(f"--strategy: {_one_line(exc, with_type=False)}") from None
    return strategy


def _output_path(text: str | None, flag: str) -> pathlib.Path | None:
    """Check before planning that ``text`` can be written (missing directories are made when it is)."""
    if text is None:
        return None
    path = pathlib.Path(text).expanduser().absolute()
    if path.is_dir():
        example = path / ("plan" + flag.replace("--", "."))
        raise _Usage(f"{flag} {text} is a directory; give a file path, e.g. {example}")
    existing = path.parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise _Usage(f"{flag} {text}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise _Usage(f"{flag} {text}: permission denied (cannot write in {existing})")
    return path


def _build(factory, called: str, args: tuple, extra: dict):
    import torch

    try:
        with torch.device("meta"):
            return factory(*args, **extra)
    except Exception as exc:  # the factory's own failure: the user's code, said in one line
        raise _Usage(f"{called} raised {_one_line(exc)}") from None


@contextlib.contextmanager
def _held_stderr(discard_on: type[BaseException]):
    """Hold what the block writes to stderr (directly or through a logging handler such as torch's)
    and pass it on after the block, unless it raises ``discard_on``: torch.export prints the partial
    graph of a failed capture and a warning to stderr, which would bury the one line saying what failed."""
    import logging

    held = io.StringIO()
    loggers = [logging.getLogger(), *(v for v in logging.Logger.manager.loggerDict.values()
                                      if isinstance(v, logging.Logger))]
    handlers = list({id(h): h for logger in loggers for h in logger.handlers
                     if isinstance(h, logging.StreamHandler) and h.stream is sys.stderr}.values())
    streams = [h.setStream(held) for h in handlers]
    try:
        with contextlib.redirect_stderr(held):
            yield
    except discard_on:
        raise
    except BaseException:
        sys.stderr.write(held.getvalue())
        raise
    else:
        sys.stderr.write(held.getvalue())
    finally:
        for handler, stream in zip(handlers, streams):
            handler.setStream(stream)


def _plan(args: argparse.Namespace) -> int:
    import torch

    from graphpass.capture import CaptureError
    from graphpass.planner import Planner, parse_memory

    cluster = _cluster(args.cluster)
    try:
        budget = None if args.memory is None else parse_memory(args.memory, "--memory")
    except ValueError as exc:
        raise _Usage(str(exc)) from None
    strategy = None if args.strategy is None else _strategy(args.strategy, cluster.world_size)
    json_path, html_path = _output_path(args.json, "--json"), _output_path(args.html, "--html")
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    shape = _batch_shape(args.batch)
    called = f"{args.factory}({', '.join(map(repr, args.arg))})"
    with phase(f"building {called}"):
        factory = _load_factory(args.factory)
        try:
            signature = inspect.signature(factory)
        except (TypeError, ValueError):
            signature = None
        wants_batch = signature is not None and "batch" in signature.parameters
        extra = {"batch": shape} if wants_batch else {}
        if signature is not None:
            try:
                signature.bind(*args.arg, **extra)
            except TypeError as exc:
                raise _Usage(f"{called}: {exc} (give the factory's arguments with --arg)") from None
        built = _build(factory, called, tuple(args.arg), extra)
        model, inputs = built if isinstance(built, tuple) else (built, None)
        if not isinstance(model, torch.nn.Module):
            raise _Usage(f"factory {args.factory!r} returned {type(model).__name__}, not a torch.nn.Module "
                         "(or a (model, example_inputs) pair)")
        model = model.to(dtypes[args.dtype])
    if inputs is not None:  # floating inputs take the model's dtype, as its activations will
        inputs = tuple(t.to(dtypes[args.dtype]) if t.is_floating_point() else t for t in inputs)
    if inputs is None:
        if len(shape) != 2:
            raise _Usage(f"--batch {args.batch!r}: a model given without example inputs takes token ids and "
                         "targets of shape BATCHxSEQ (or let the factory return (model, example_inputs))")
        inputs = tuple(torch.zeros(shape, dtype=torch.long, device="meta") for _ in range(2))
    name = type(model).__name__
    try:
        with phase(f"capturing {name} and pricing its ops"), _held_stderr(discard_on=CaptureError):
            planner = Planner(model, cluster, inputs, budget, optimizer_states=args.optimizer_states)
        if strategy is None:
            with phase(f"searching meshes for {name} on {cluster.world_size} devices"):
                chosen = planner.auto(args.time_limit)
        else:
            with phase(f"pricing {strategy}"):
                chosen = planner.price(strategy)
    except CaptureError as exc:  # the model's forward, not graphpass: one line naming each route's reason
        raise _Usage(_one_line(exc, with_type=False)) from None
    except (ValueError, NotImplementedError) as exc:
        # NoPlanError, PlanningError, a batch no mesh divides, a strategy the model cannot take
        raise _Usage(str(exc).splitlines()[0].replace("raise memory_budget", "raise --memory")) from None
    # Files first: a reader who stops reading (`| head`) still gets them.
    written = []
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(chosen.to_json() + "\n")
        written.append(f"plan: {json_path.resolve()}")
    if html_path is not None:
        chosen.to_html(html_path)
        written.append(f"page: {html_path.resolve()}")
    print(f"{args.factory}{'(' + ', '.join(args.arg) + ')' if args.arg else ''}: "
          f"{_count(sum(p.numel() for p in model.parameters()))} parameters, {args.dtype}, "
          f"batch {args.batch} on {cluster.explain()}")
    print(chosen.explain())
    for line in written:
        print(line)
    return 0


def torchrun_command(nproc: int, script: str, script_args: list[str], port: int) -> list[str]:
    """The torchrun line ``graphpass run`` executes: one node, every address 127.0.0.1."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(port), "--local-addr", "127.0.0.1",
            script, *script_args]


def _run(args: argparse.Namespace) -> int:
    from graphpass.runtime.launch import free_port, pin_gloo_to_loopback

    if args.n < 1:
        raise _Usage(f"-n {args.n}: give the number of local ranks, 1 or more")
    if not pathlib.Path(args.script).is_file():
        raise _Usage(f"no such script {args.script}")
    pin_gloo_to_loopback()  # loopback only, as graphpass.launch does (unless GLOO_SOCKET_IFNAME is set)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.n)))
    return subprocess.call(torchrun_command(args.n, args.script, args.args, free_port()), env=env)


def _env(_: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    import graphpass
    from graphpass.cluster import cache_dir

    def version(name: str) -> str:
        try:
            return importlib.import_module(name).__version__
        except ImportError:
            return "not installed"
        except AttributeError:
            return "installed"

    print(f"graphpass {graphpass.__version__} ({pathlib.Path(graphpass.__file__).parent})")
    print(f"python {platform.python_version()} on {platform.platform()}, {os.cpu_count()} CPUs")
    print(f"torch {torch.__version__} (CUDA build {torch.version.cuda or 'none'})")
    for name in ("ortools", "sympy", "networkx", "transformers", "tqdm", "pytest"):
        print(f"{name} {version(name)}")
    backends = [b for b in ("gloo", "nccl", "mpi") if getattr(dist, f"is_{b}_available")()]
    print(f"torch.distributed backends: {', '.join(backends) or 'none'}")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            print(f"cuda:{i} {props.name}, {props.total_memory / 2**30:.1f} GiB")
    else:
        print("devices: cpu only (no CUDA device visible)")
    root = cache_dir()
    files = sorted(p.relative_to(root) for p in root.rglob("*.json")) if root.is_dir() else []
    print(f"profile cache {root}: " + (", ".join(map(str, files)) if files else "no profiles (graphpass profile writes one)"))
    for var in ("GRAPHPASS_CACHE_DIR", "GRAPHPASS_DUMP_DIR", "GRAPHPASS_DISABLE_PASSES", "GRAPHPASS_QUIET",
                "GLOO_SOCKET_IFNAME", "MASTER_ADDR", "WORLD_SIZE"):
        if var in os.environ:
            print(f"{var}={os.environ[var]}")
    return 0


def _dumps(args: argparse.Namespace) -> int:
    root = pathlib.Path(args.dir)
    summary = root / "summary.txt"
    if not summary.is_file():
        raise _Usage(f"{root} has no summary.txt (was it written with dump_dir=?)")
    print(summary.read_text().rstrip())
    for rank_dir in sorted(root.glob("rank*")):
        graphs = sorted(rank_dir.glob("*.py"))
        if not graphs:
            continue
        calls = _COLLECTIVE_RE.findall(graphs[-1].read_text())
        print(f"{rank_dir.name}: {graphs[-1].name}: collectives in order: {', '.join(calls) or 'none'}")
    return 0


def _profile(args: argparse.Namespace) -> int:
    from graphpass.cost.profiler import run_profile  # imports torch: only for this command

    dtypes = args.dtypes.split(",") if args.dtypes else None
    try:
        report = run_profile(world_size=args.world_size, path=args.out, dtypes=dtypes, quick=args.quick)
    except ValueError as exc:
        raise _Usage(str(exc)) from None
    print(report.summary())
    return 0


_EPILOGS = {
    "plan": """example:
  graphpass plan examples/configs.py:build --arg gpt3-175b --cluster h100-80g:128x8 \\
      --memory 70GiB --batch 1536x2048 --dtype bf16 --json plan.json --html plan.html

FACTORY(*ARGS) runs under torch.device("meta") (nothing is allocated) and returns the model, whose
forward(idx, targets) takes BATCHxSEQ token ids, or (model, example_inputs); a factory with a
`batch` parameter is given the --batch shape as a tuple.""",
    "run": """example:
  graphpass run -n 4 examples/train_gpt.py --world-size 4 --steps 5

Runs torchrun with one node on 127.0.0.1. On a real cluster run torchrun on every node instead:
  torchrun --nnodes NODES --nproc-per-node GPUS --node-rank I \\
      --rdzv-backend c10d --rdzv-endpoint HOST0:29500 train.py ARGS""",
    "explain": "example:\n  graphpass explain dumps/plan.json --html plan.html",
    "dumps": "example:\n  graphpass dumps dumps/train_gpt",
    "presets": "example:\n  graphpass presets",
    "profile": "example:\n  graphpass profile --world-size 2 --quick",
    "env": "example:\n  graphpass env > env.txt   # attach to a bug report",
}


def _subparser(sub, name: str, help_text: str, fn):
    p = sub.add_parser(name, help=help_text, description=help_text, epilog=_EPILOGS[name],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(fn=fn)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``graphpass`` console script."""
    parser = _Parser(prog="graphpass", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = _subparser(sub, "plan", "plan a model for a cluster without the cluster (fake tensors)", _plan)
    p.add_argument("factory", metavar="MODULE:FACTORY", help="e.g. configs:build or examples/configs.py:build")
    p.add_argument("--arg", action="append", default=[], metavar="ARG", help="a string argument to the factory (repeatable)")
    p.add_argument("--cluster", required=True, help="preset NAME or NAME:NODESxGPUS, e.g. h100-80g:16x8 (see graphpass "
                   "presets), or a cluster JSON file (graphpass profile --out writes one)")
    p.add_argument("--batch", required=True, help="global batch, BATCHxSEQ for token models, e.g. 512x2048")
    p.add_argument("--memory", default=None, help="per-device budget, e.g. 70GiB (default "
                   f"{DEFAULT_MEMORY_FRACTION * 100:.0f}%% of the device)")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"), help="parameter dtype (default bf16)")
    p.add_argument("--optimizer-states", type=int, default=2, help="fp32 states per parameter (2: Adam, 1: SGD momentum)")
    p.add_argument("--time-limit", type=float, default=None, help="stop searching after this many seconds")
    p.add_argument("--strategy", default=None, metavar="KEY=VALUE,...",
                   help="price this strategy instead of searching, e.g. dp=8,tp=8,zero=1 (keys: the fields of "
                   "graphpass.Strategy; dp defaults to the devices tp x pp leave)")
    p.add_argument("--json", default=None, help="write the plan as JSON here")
    p.add_argument("--html", default=None, help="write the plan's page here")
    p = _subparser(sub, "run", "run a script on N local ranks through torchrun (loopback only)", _run)
    p.add_argument("-n", type=int, required=True, help="local ranks")
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    p = _subparser(sub, "explain", "explain a saved plan.json", _explain)
    p.add_argument("plan")
    p.add_argument("--html", default=None, help="also write the plan's page here")
    p = _subparser(sub, "dumps", "summarise a dump directory", _dumps)
    p.add_argument("dir")
    _subparser(sub, "presets", "list cluster presets", _presets)
    p = _subparser(sub, "profile", "measure this machine's device and links into a cluster JSON", _profile)
    p.add_argument("--world-size", type=int, default=1, help="local ranks to profile (default 1)")
    p.add_argument("--out", default=None, help="JSON path (default: where Cluster.local looks)")
    p.add_argument("--dtypes", default=None, help="comma-separated matmul dtypes, e.g. bf16,fp32")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats (seconds)")
    _subparser(sub, "env", "print versions, backends, devices and profiles for a bug report", _env)
    args = parser.parse_args(argv)
    try:
        status = args.fn(args)
        sys.stdout.flush()  # here, so that a closed pipe is seen here rather than at exit
        return status
    except _Usage as exc:
        print(f"graphpass {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `graphpass plan ... | head`: the reader stopped; the files are written
        _discard_stdout()
        return 0


def _discard_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's final flush does not fail on the closed pipe."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (a test's stream)
        sys.stdout = open(os.devnull, "w")
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
