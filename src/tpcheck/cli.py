"""The `tpcheck` command line. `main(argv) -> exit code`:

0  every case went as expected (correct implementations equivalent, injected faults caught)
1  some case did not (a TP implementation differs from its dense twin, or a fault was missed)
2  bad input (the message names the value and the fix), or an output (--json, --html, stdout) that
   could not be written after the run (the others are still written)
3  no verdict: a rank raised or died, or the checker failed its own control (the message says which)
130, 143, 129  interrupted by SIGINT (Ctrl-C), SIGTERM or SIGHUP: every rank is stopped at once, the
   cases that finished are reported (marked `interrupted`), temp dirs are removed; a second signal
   exits at once

`tpcheck torchrun TORCHRUN_ARGS -- COMMAND` (torchrun's launcher in this process, `python -m tpcheck COMMAND`
on each rank) exits 0 when every rank exited 0, else by the ranks' codes: 2 if any rank said 2, else 3 if any
said 3, died of a signal or exited with another code, else 1 (a rank torchrun stopped once another had
exited does not count); one line on stderr per distinct code, no torchrun traceback. Its own bad input
(no `--`, nothing or no rank-starting command after it, torchrun's argument errors) is 2 before anything
starts; a signal to the launcher exits 128 + its number once torchrun has stopped every rank.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import signal
import sys

from tpcheck.errors import ExitCode, UsageError

MODES = ("inspect", "equivalence", "missing_forward_reduce", "missing_backward_reduce", "all")  # = seed.MODES
# Options `run --mode` applies (by argparse dest); any other option given with --mode is refused.
MODE_OPTIONS = {"mode", "world_size", "preset", "steps", "optimizer", "lr", "seed", "timeout", "json_path",
                "html_path", "quiet"}
INSPECT_OPTIONS = {"mode", "world_size", "json_path", "html_path", "quiet"}  # inspect runs nothing
MIN_TIMEOUT_S, MAX_TIMEOUT_S = 1.0, 3600.0
MAX_LR = 10.0  # the seed MLP's dense reference overflows to Inf/NaN at lr 30 with SGD


DTYPE_ALIASES = {"fp32": "float32", "f32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
                 "f16": "float16", "half": "float16", "fp64": "float64", "f64": "float64", "double": "float64"}
EXAMPLES = {
    None: """examples:
  tpcheck run --world-size 2 4                       # the built-in MLP block, float32, 3 AdamW steps
  tpcheck verify my_case.py --world-size 2 4         # your own TP code (docs/case-files.md)
  tpcheck run --block layer --dtype bf16 --fault all # every catalogue fault that applies, in bfloat16
  tpcheck hf llama mistral --world-size 2 4          # HuggingFace transformers' own TP plans
  tpcheck faults                                     # the fault catalogue
  tpcheck torchrun --nproc_per_node 2 -- verify my_case.py --world-size 2   # under torchrun, a clean exit""",
    "run": """examples:
  tpcheck run --block mlp attention --world-size 2 4 --dtype float32 bf16
  tpcheck run --block layer --sp --fault all --json r.json --html r.html
  tpcheck run --block layer lm --preset tiny --dropout 0.1 --attention-dropout 0.1 --world-size 2 4
  tpcheck run --mode all --world-size 2              # the seed's modes, its JSON on stdout
  tpcheck run --block layer --preset tiny --world-size 2 --device cuda   # one GPU per rank, NCCL""",
    "verify": """examples:
  tpcheck verify my_case.py                          # every case in the file, world size 2
  tpcheck verify my_case.py:buggy --world-size 2 4   # one case, two world sizes
  tpcheck verify a.py b.py --dtype bf16 --steps 5 --json r.json
  tpcheck verify my_case.py --device cuda --world-size 2   # on GPUs, one per rank""",
    "hf": """examples:
  tpcheck hf llama qwen3 --world-size 2 4            # two architectures, transformers' own plans
  tpcheck hf --all --json sweep.json --html sweep.html   # every architecture with a TP plan
  tpcheck hf qwen3 --micro-batches 1                 # one micro-batch (no gradient accumulation)
  tpcheck hf qwen3 --rule 'model.layers.*.self_attn.q_norm=replicate'   # override a plan rule
  tpcheck hf --list                                  # the architectures with a TP plan""",
    "new": """examples:
  tpcheck new my_case.py && tpcheck verify my_case.py --world-size 2 4""",
    "faults": """examples:
  tpcheck faults
  tpcheck faults --json | python -m json.tool""",
    "report": """examples:
  tpcheck report r.json --html r.html""",
    "torchrun": """Everything before `--` is torchrun's (python -m torch.distributed.run --help lists it), everything
after it the tpcheck command each rank runs (run, verify or hf). The exit code is the verdict's, said in
one line per outcome, without torchrun's ChildFailedError traceback and failure summary.

examples:
  tpcheck torchrun --nproc_per_node 2 -- verify case.py --world-size 2 --json r.json
  tpcheck torchrun --nproc_per_node 4 -- run --block layer --world-size 4
  tpcheck torchrun --nnodes 2 --nproc_per_node 1 --rdzv_backend c10d --rdzv_endpoint HOST0:29500 \\
      --rdzv_id c1 -- verify case.py --world-size 2      # on each host""",
}


def dtype_name(text: str) -> str:
    """A --dtype value, aliases (bf16, fp32, half, ...) spelled out."""
    return DTYPE_ALIASES.get(text.lower(), text)


def build_parser() -> argparse.ArgumentParser:
    from tpcheck._version import __version__

    parser = argparse.ArgumentParser(prog="tpcheck", description="Prove a tensor-parallel implementation "
                                     "computes what its dense model computes; say where and why when not.",
                                     epilog=EXAMPLES[None], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"tpcheck {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, epilog=EXAMPLES[name], formatter_class=argparse.RawDescriptionHelpFormatter)

    run = command("run", "check built-in blocks (a matrix of blocks x world sizes x dtypes x faults)")
    run.add_argument("--mode", choices=MODES, help="the seed's modes on the seed fixture (prints the seed's JSON); "
                     "'all' runs inspect and the three run modes in one launch")
    run.add_argument("--block", nargs="+", default=["mlp"], help="blocks to check (default: mlp)")
    run.add_argument("--preset", default=None, help="model shapes: seed, tiny, llama3-8b-layer (default: seed)")
    run.add_argument("--world-size", type=int, nargs="+", default=None, help="TP world sizes (default: 2)")
    run.add_argument("--dtype", nargs="+", default=["float32"], type=dtype_name,
                     help="float32, bfloat16, float16, float64, or bf16, fp16, fp32, fp64 (default: float32)")
    run.add_argument("--sp", action="store_true", help="sequence parallelism")
    run.add_argument("--fault", nargs="+", default=[], help="inject catalogue faults ('all' for every one)")
    run.add_argument("--steps", type=int, default=None, help="optimizer steps (default 3; 1 for --mode)")
    run.add_argument("--optimizer", choices=("sgd", "adamw"), default=None, help="default adamw (sgd for --mode)")
    run.add_argument("--lr", type=float, default=None, help="learning rate, up to 10 (default 1e-3 AdamW, 0.05 SGD)")
    run.add_argument("--micro-batches", type=int, default=2,
                     help="gradient accumulation: micro-batches per step (default 2)")
    _add_precision_arg(run)
    run.add_argument("--seed", type=int, default=31, help="seed of the weights and batches (default 31)")
    run.add_argument("--dropout", type=float, default=None, metavar="P",
                     help="hidden dropout of the blocks (after the embedding, on each block's output); default 0")
    run.add_argument("--attention-dropout", type=float, default=None, metavar="P",
                     help="dropout of the attention probabilities; default 0")
    _add_device_arg(run)
    _add_output_args(run)
    run.set_defaults(func=cmd_run)

    verify = command("verify", "check your own TP code: a case file (docs/case-files.md)")
    verify.add_argument("target", nargs="*", help="path/to/case.py or path/to/case.py:NAME")
    # str: `--world-size 2 4 case.py` takes the case file too; cmd_verify hands it back to the targets
    verify.add_argument("--world-size", nargs="+", default=None, metavar="WORLD_SIZE", help="TP world sizes (default: 2)")
    verify.add_argument("--dtype", nargs="+", default=None, type=dtype_name,
                        help="override the case's dtype(s): float32, bfloat16 (bf16), float16 (fp16), float64")
    verify.add_argument("--steps", type=int, default=None, help="override the case's optimizer steps")
    verify.add_argument("--optimizer", choices=("sgd", "adamw"), default=None, help="override the case's optimizer")
    verify.add_argument("--lr", type=float, default=None, help="override the case's learning rate (up to 10)")
    verify.add_argument("--micro-batches", type=int, default=None, help="override the case's micro-batches per step")
    _add_precision_arg(verify)
    verify.add_argument("--seed", type=int, default=None, help="override the case's seed of weights and batches")
    verify.add_argument("--print-plan", action="store_true",
                        help="print, on stdout, the plan inferred for each case without one (Case(plan=None, load_tp=...))")
    _add_device_arg(verify)
    _add_output_args(verify)
    verify.set_defaults(func=cmd_verify)

    hf = command("hf", "check HuggingFace transformers' own TP plans, architecture by architecture "
                       "(pip install 'tpcheck[transformers]')")
    hf.add_argument("architecture", nargs="*", help="model types (llama, qwen3, mixtral, ...); see --list")
    hf.add_argument("--all", dest="all_architectures", action="store_true",
                    help="every architecture whose config declares a TP plan")
    hf.add_argument("--list", dest="list_architectures", action="store_true",
                    help="print the architectures with a TP plan and exit")
    hf.add_argument("--world-size", type=int, nargs="+", default=[2], help="TP world sizes (default: 2)")
    hf.add_argument("--dtype", nargs="+", default=["float32"], type=dtype_name,
                    help="float32, bfloat16 (bf16), float16 (fp16), float64 (default: float32)")
    hf.add_argument("--steps", type=int, default=None, help="optimizer steps (default 2)")
    hf.add_argument("--micro-batches", type=int, default=2,
                    help="gradient accumulation: micro-batches per step (default 2)")
    hf.add_argument("--optimizer", choices=("sgd", "adamw"), default="adamw", help="default adamw")
    hf.add_argument("--lr", type=float, default=None, help="learning rate, up to 10 (default 1e-3)")
    _add_precision_arg(hf)
    hf.add_argument("--seed", type=int, default=31, help="seed of the weights and batches (default 31)")
    hf.add_argument("--rule", action="append", metavar="PATTERN=STYLE",
                    help="override one rule of transformers' plan (repeatable), e.g. "
                         "'model.layers.*.mlp.down_proj=rowwise'")
    hf.add_argument("--full", action="store_true",
                    help="keep every check of every case in the JSON (default: the failed ones, and counts)")
    _add_output_args(hf)
    hf.set_defaults(func=cmd_hf)

    new = command("new", "write a commented case file to start from (it verifies as written)")
    new.add_argument("path", metavar="CASE.py", help="where to write it (never over an existing file)")
    new.set_defaults(func=cmd_new)

    faults = command("faults", "list the fault catalogue")
    faults.add_argument("--json", action="store_true", help="as JSON")
    faults.set_defaults(func=cmd_faults)

    report = command("report", "print the summary of a JSON report and render it as HTML")
    report.add_argument("result", metavar="RESULT.json", help="a report written by `tpcheck run --json`")
    report.add_argument("--html", dest="html_path", metavar="PATH", help="write the HTML report here")
    report.set_defaults(func=cmd_report)

    # `main` hands `tpcheck torchrun ...` over before argparse (which would take torchrun's options for its
    # own); this parser prints the help and lists the command
    torchrun = command("torchrun", "run a tpcheck command under torchrun's launcher, its exit code said in one line "
                                   "(no ChildFailedError traceback)")
    torchrun.add_argument("torchrun_argv", nargs=argparse.REMAINDER, metavar="TORCHRUN_ARGS -- COMMAND",
                          help="torchrun's arguments (e.g. --nproc_per_node 2), `--`, then a tpcheck command "
                               "(run, verify or hf) and its arguments")
    torchrun.usage = "%(prog)s [-h] [TORCHRUN_ARGS ...] -- {run,verify,hf} [ARGS ...]"
    torchrun.set_defaults(func=cmd_torchrun)
    return parser


def _add_precision_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-master-weights", dest="master_weights", action="store_false", default=None,
                   help="with bfloat16/float16: pure 16-bit parameters and optimizer state (default: float32 "
                        "master weights, grads and optimizer state, as Megatron-Core and torchtitan train)")


def _add_device_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the ranks compute: cpu (gloo, the default) or cuda (one GPU per rank, NCCL)")


def _add_output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--timeout", type=float, default=None, help="seconds any collective may wait, 1..3600 (default 20)")
    p.add_argument("--json", dest="json_path", metavar="PATH", help="write the full JSON report here")
    p.add_argument("--html", dest="html_path", metavar="PATH", help="write the HTML report here")
    p.add_argument("-q", "--quiet", action="store_true", help="no summary on stderr")


def entry() -> None:
    """The `tpcheck` command: `main`, then exit without torch's slow interpreter teardown (about a
    second; gloo sometimes aborts in it), once stdout and stderr are flushed. Its own process computes
    on one thread, so that the ranks it forks may share the CPUs (checker/pool/spawn.py)."""
    from tpcheck.checker.pool.spawn import keep_parent_to_one_thread

    keep_parent_to_one_thread()
    code = main()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    if sys.stderr is None:  # started with stderr closed: print(file=None) would write to stdout
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_argv(argv)
    args.argv = argv
    try:
        with StopOnSignals():
            code = args.func(args)
    except UsageError as e:
        print(f"tpcheck: error: {e}", file=sys.stderr)
        code = ExitCode.USAGE
    except Interrupted as e:  # before any case ran (while importing a case file, say)
        print(f"tpcheck: interrupted by {e.name}: nothing was checked", file=sys.stderr)
        code = e.exit_code
    problem = write_stdout("")  # what is still buffered: a full disk or a closed pipe shows here
    if problem:
        print(f"tpcheck: error: {problem}", file=sys.stderr)
        return ExitCode.USAGE
    return code


def parse_argv(argv: list[str]) -> argparse.Namespace:
    """argv as argparse reads it, but for `tpcheck torchrun ARGS`: its ARGS are torchrun's and a tpcheck
    command's, which argparse would take for tpcheck's options (help excepted)."""
    if argv[:1] == ["torchrun"]:
        from tpcheck.torchrun import asks_for_help

        if not asks_for_help(argv[1:]):
            return argparse.Namespace(command="torchrun", torchrun_argv=argv[1:], func=cmd_torchrun)
        argv = ["torchrun", "--help"]
    return build_parser().parse_args(argv)


def cmd_torchrun(args: argparse.Namespace) -> int:
    """torchrun's launcher in this process; the tpcheck command after `--` is parsed here first, so that its
    flag errors are said once, before any rank starts."""
    from tpcheck import torchrun

    return torchrun.main(args.torchrun_argv, build_parser().parse_args)


# ------------------------------------------------------------------------------ signals

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(BaseException):
    """A signal stopped the run (a BaseException, like KeyboardInterrupt: no `except Exception` in
    user or library code swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum, self.name = signum, signal.Signals(signum).name

    @property
    def exit_code(self) -> int:
        return ExitCode.interrupted(self.signum)


class StopOnSignals:
    """While a command runs: the first SIGINT/SIGTERM/SIGHUP raises Interrupted in the main thread
    (the run stops its ranks and reports what finished); a second one kills every rank, removes the
    temp dirs and exits at once. Handlers are restored on exit (tests call `main` in-process)."""

    def __init__(self) -> None:
        self.saved: dict[int, object] = {}
        self.count = 0

    def __enter__(self) -> StopOnSignals:
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self.saved[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame) -> None:
        self.count += 1
        if self.count > 1:
            from tpcheck.checker.pool.spawn import kill_all

            kill_all()
            print(f"tpcheck: interrupted again by {signal.Signals(signum).name}: stopped at once", file=sys.stderr)
            os._exit(ExitCode.interrupted(signum))
        raise Interrupted(signum)

    def __exit__(self, *exc) -> None:
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)


# ------------------------------------------------------------------------------ flags and outputs


def check_common_flags(args: argparse.Namespace) -> None:
    """What `run` and `verify` check alike before any rank starts: --timeout, --lr, the output paths."""
    from tpcheck.report.output import check_output_path

    if args.timeout is not None and not MIN_TIMEOUT_S <= args.timeout <= MAX_TIMEOUT_S:
        raise UsageError(f"--timeout {args.timeout:g} must be between {MIN_TIMEOUT_S:g} and {MAX_TIMEOUT_S:g} seconds: "
                         f"it is how long any collective may wait, and below {MIN_TIMEOUT_S:g} s a correct "
                         "implementation is reported as a false hang")
    if args.lr is not None and math.isfinite(args.lr) and args.lr > MAX_LR:
        raise UsageError(f"--lr {args.lr:g} is above {MAX_LR:g}: steps that large make the weights, and the dense "
                         "reference itself, overflow to Inf/NaN within a few steps (the seed MLP's does at lr 30 "
                         "with SGD), leaving nothing to compare; typical learning rates are 1e-5..1e-1")
    check_output_path("--json", args.json_path)
    check_output_path("--html", args.html_path)


def given_options(argv: list[str]) -> dict[str, str]:
    """{dest: flag} of the options typed in `argv` (not those left at their defaults): argv is parsed
    again by a parser whose options default to nothing. (argparse lists a parser's options only in its
    `_actions`: there is no public way.)"""
    parser = build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for command in commands.choices.values():
        for action in command._actions:
            if action.option_strings:
                action.default = argparse.SUPPRESS
    given = vars(parser.parse_args(argv))
    return {a.dest: max(a.option_strings, key=len) for a in commands.choices[given["command"]]._actions
            if a.option_strings and a.dest in given}


def refuse_options_the_mode_ignores(args: argparse.Namespace) -> None:
    """`run --mode` checks the seed's fixture: options given that it would not apply are refused."""
    inspect = args.mode == "inspect"
    applies = INSPECT_OPTIONS if inspect else MODE_OPTIONS
    ignored = [flag for dest, flag in given_options(args.argv).items() if dest not in applies]
    if not ignored:
        return
    them = "it" if len(ignored) == 1 else "them"
    does = ("runs nothing, it prints the seed MLP's shapes for --world-size ranks" if inspect else
            "checks the seed's MLP block in float32, without sequence parallelism, one micro-batch per step, with "
            "the mode's own fault")
    fix = f"drop {them}" if inspect else f"drop {them}, or drop --mode to run the matrix check with {them}"
    raise UsageError(f"--mode {args.mode} ignores {', '.join(ignored)}: it {does}; {fix}")


def check_inspect_world_size(world_size: int) -> None:
    """inspect shows the seed MLP split over `world_size` ranks: refuse a world size a run would refuse."""
    from tpcheck.checker.case import CaseSpec
    from tpcheck.resolve import RESOLVER

    RESOLVER.validate(CaseSpec(block="mlp", preset="seed", world_size=world_size))


def write_stdout(text: str) -> str | None:
    """Write `text` to stdout and flush it; on failure (a full disk, a closed pipe) return the problem and
    point stdout at /dev/null, so that Python's own flush at exit cannot fail again with a traceback."""
    if sys.stdout is None:  # started with stdout closed
        return "stdout is closed: the seed's JSON was not printed" if text else None
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:  # the reader stopped reading (`tpcheck faults | head`): not an error
        _stdout_to_devnull()
        return None
    except OSError as e:
        _stdout_to_devnull()
        return f"stdout: cannot write: {e.strerror or e}"
    return None


def _stdout_to_devnull() -> None:
    """Point stdout's file descriptor at /dev/null: what is still buffered cannot fail again at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no file descriptor behind sys.stdout: nothing left to flush at exit
        pass


def render_output(flag: str, report: dict) -> str:
    """The text of one report output: '--json' or '--html'."""
    if flag == "--json":
        return json.dumps(report, indent=2, sort_keys=True) + "\n"
    from tpcheck.report.html import render_html

    return render_html(report)


def write_outputs(report: dict, outputs: dict[str, str | None], quiet: bool) -> list[str]:
    """Write the report to each output given ({flag: path}); one that fails is skipped and the others are
    still written. Returns a line per failure."""
    from tpcheck.report.schema import write_atomic

    failed = []
    for flag, path in outputs.items():
        if path is None:
            continue
        try:
            write_atomic(path, render_output(flag, report))
        except OSError as e:
            failed.append(f"{flag} {path!r}: cannot write the report: {e.strerror or e}")
        else:
            if not quiet:
                print(f"{flag[2:].upper()} report: {path}", file=sys.stderr)
    return failed


def exit_after_outputs(failed: list[str], code: int) -> int:
    """The exit code once the outputs are written: 2 when one failed (each said on stderr), else `code`."""
    if not failed:
        return code
    for line in failed:
        print(f"tpcheck: error: {line}", file=sys.stderr)
    print(f"tpcheck: error: exit 2 because an output failed (the checks alone give exit {code}; the other "
          "outputs were written)", file=sys.stderr)
    return ExitCode.USAGE


# ------------------------------------------------------------------------------ run


def cmd_run(args: argparse.Namespace) -> int:
    from tpcheck.checker.pool.launch import under_torchrun

    check_common_flags(args)
    world_sizes = args.world_size or [int(os.environ["WORLD_SIZE"]) if under_torchrun() else 2]
    if args.mode:
        from tpcheck.seed import mode_specs

        refuse_options_the_mode_ignores(args)
        if len(world_sizes) != 1:
            raise UsageError(f"--mode takes one --world-size, got {world_sizes}")
        if args.mode in ("inspect", "all") and not under_torchrun():
            check_inspect_world_size(world_sizes[0])
        specs = mode_specs(args.mode, world_sizes[0], preset=args.preset, steps=args.steps, optimizer=args.optimizer,
                           lr=args.lr, seed=args.seed)
    else:
        specs = matrix_specs(args, world_sizes)
    return execute(specs, args, seed_mode=args.mode, seed_world_size=world_sizes[0])


def matrix_specs(args: argparse.Namespace, world_sizes: list[int]) -> list:
    from tpcheck.checker.case import CaseSpec, RunSettings
    from tpcheck.faults import CATALOGUE, get_fault
    from tpcheck.resolve import feasible

    faults: list[str | None] = [None]
    if args.fault == ["all"]:
        faults += list(CATALOGUE)
    else:
        faults += [get_fault(f).name for f in args.fault]
    specs = []
    for block, ws, dtype, fault in itertools.product(args.block, world_sizes, args.dtype, faults):
        run = RunSettings(dtype=dtype, steps=3 if args.steps is None else args.steps,
                          optimizer=args.optimizer or "adamw", lr=args.lr, micro_batches=args.micro_batches,
                          seed=args.seed, master_weights=args.master_weights is not False)
        spec = CaseSpec(block=block, preset=args.preset or "seed", world_size=ws, run=run, sequence_parallel=args.sp,
                        overrides=dropout_overrides(args))
        if fault is None:
            specs.append(spec)
        elif CATALOGUE[fault].applies(block, ws, run.optimizer, dtype, run.micro_batches, run.master_weights):
            faulty = CATALOGUE[fault].prepare(spec)
            if feasible(faulty):
                specs.append(faulty)
    if not specs:
        raise UsageError("no case to run: the faults given apply to none of the blocks and world sizes given")
    return specs


def dropout_overrides(args: argparse.Namespace) -> tuple:
    """The blocks' dropout probabilities given on the command line, as config overrides."""
    return tuple((name, value) for name, value in (("dropout", args.dropout),
                                                    ("attention_dropout", args.attention_dropout))
                 if value is not None)


def split_world_sizes_from_targets(args: argparse.Namespace) -> None:
    """`--world-size 2 4 case.py` puts the case file among the world sizes (argparse cannot tell): the
    integers are world sizes, the rest targets. At least one target is required."""
    sizes, moved = [], []
    for value in args.world_size or []:
        if value.lstrip("+-").isdigit():
            sizes.append(value)
        elif value.endswith(".py") or ".py:" in value:
            moved.append(value)
        else:
            raise UsageError(f"--world-size {value}: a world size is a whole number (e.g. --world-size 2 4)")
    args.world_size = [int(v) for v in sizes] or None
    args.target = [*args.target, *moved]
    if not args.target:
        raise UsageError("verify needs a case file: tpcheck verify path/to/case.py[:NAME] (docs/case-files.md)")


def target_spec(target: str, world_size: int, dtype: str | None, given: dict, broken: dict):
    """The spec of one case-file target; for a target that cannot be loaded, a spec that fails again
    (with the same message) when the launcher validates it: one invalid case, the other targets still run."""
    from tpcheck.checker.case import FILE_PREFIX, CaseSpec
    from tpcheck.checker.usercode import file_spec

    try:
        return file_spec(target, world_size, dtype=dtype, **given)
    except UsageError as e:
        spec = CaseSpec(block=FILE_PREFIX + target, world_size=world_size, label=f"{target}/tp{world_size}")
        broken[spec] = e
        return spec


def cmd_verify(args: argparse.Namespace) -> int:
    """Case files: the world size is the launcher's; flags given override the Case's own values."""
    from tpcheck.checker.pool.launch import under_torchrun
    from tpcheck.checker.usercode import expand_target

    check_common_flags(args)
    split_world_sizes_from_targets(args)
    world_sizes = args.world_size or [int(os.environ["WORLD_SIZE"]) if under_torchrun() else 2]
    given = {"steps": args.steps, "optimizer": args.optimizer, "lr": args.lr,
             "micro_batches": args.micro_batches, "seed": args.seed, "master_weights": args.master_weights}
    targets = []
    for t in args.target:  # a file with several cases: all of them; a broken file: one invalid case
        try:
            targets += expand_target(t)
        except UsageError:
            targets.append(t)
    broken: dict = {}
    specs = [target_spec(t, ws, d, given, broken)
             for t, ws, d in itertools.product(targets, world_sizes, args.dtype or [None])]
    if len(broken) == len(specs):
        raise next(iter(broken.values()))  # nothing to run: the first problem, exit 2
    return execute(specs, args)


def cmd_hf(args: argparse.Namespace) -> int:
    """HuggingFace architectures: skipped ones are rows of the sweep, the others cases."""
    from tpcheck import hf

    if args.list_architectures:
        names = hf.select([], True)
        problem = write_stdout("".join(f"{n}\n" for n in names))
        return exit_after_outputs([problem] if problem else [], 0)
    check_common_flags(args)
    if any(w < 2 for w in args.world_size):
        raise UsageError(f"--world-size {' '.join(map(str, args.world_size))}: transformers shards nothing on one "
                         "rank; give 2 or more")
    names = hf.select(args.architecture, args.all_architectures)
    rules = hf.parse_rules(args.rule)
    settings = {"steps": hf.SWEEP_STEPS if args.steps is None else args.steps, "micro_batches": args.micro_batches,
                "optimizer": args.optimizer, "lr": args.lr, "seed": args.seed,
                "master_weights": True if args.master_weights is None else args.master_weights}
    specs, skipped = hf.plan_sweep(names, args.world_size, args.dtype, rules, **settings)
    if not specs:
        raise UsageError("nothing to check: " + "; ".join(f"{r['architecture']} (tp{r['world_size']}) skipped: "
                                                          f"{r['reason']}" for r in skipped[:5]))

    def finish(report: dict) -> None:
        report["sweep"] = hf.sweep_section(report["cases"], skipped, args.world_size, rules)
        if not args.full:
            report["cases"] = [hf.compact(r) for r in report["cases"]]
        if not args.quiet:
            for row in skipped:
                print(f"tpcheck: {row['architecture']} (tp{row['world_size']}) skipped: {row['reason']}",
                      file=sys.stderr)
            print(f"tpcheck hf: {report['sweep']['summary']}", file=sys.stderr)

    return execute(specs, args, finish_report=finish)


def on_device(specs: list, device: str, torchrun: bool) -> list:
    """The specs with `--device`; on "cuda", refused at once (exit 2) where this machine has no GPU for
    every rank (under torchrun each rank checks its own machine)."""
    from tpcheck.checker.devices import check_device

    if device == "cpu":
        return specs
    if not torchrun:
        check_device(device, max(s.world_size for s in specs))
    return [dataclasses.replace(s, device=device, label=f"{s.label}/{device}" if s.label else "") for s in specs]


def execute(specs: list, args: argparse.Namespace, seed_mode: str | None = None, seed_world_size: int = 2,
            finish_report=None) -> int:
    """Run specs (forked pool, or the torchrun ranks), print and write reports, return the exit code.
    seed_mode: the seed's JSON for that mode goes to stdout (inspect: for `seed_world_size` ranks).
    finish_report(report): adds to the report before it is written (the HF sweep's table)."""
    from tpcheck.checker.pool.launch import DEFAULT_TIMEOUT_S, under_torchrun
    from tpcheck.checker.pool.session import run_specs
    from tpcheck.checker.verdict.result import exit_code
    from tpcheck.report.console import print_summary, progress_printer
    from tpcheck.report.schema import build_report
    from tpcheck.resolve import RESOLVER, torchrun_launcher
    from tpcheck.resolve import launcher as pool_launcher

    timeout = DEFAULT_TIMEOUT_S if args.timeout is None else args.timeout
    specs = on_device(specs, getattr(args, "device", "cpu"), under_torchrun())
    if not under_torchrun():  # bad input fails fast, before any rank is forked
        problems = []
        for spec in specs:
            try:
                RESOLVER.validate(RESOLVER.prepare(spec))
            except UsageError as e:
                problems.append(e)
        if problems and len(problems) == len(specs):
            raise problems[0]  # nothing to run: the first problem, exit 2
        # otherwise each bad case is one "invalid" result (the launcher validates it again), the rest run
    launcher = torchrun_launcher(timeout) if under_torchrun() else pool_launcher(timeout)
    try:
        progress = None if args.quiet or len(specs) < 2 else progress_printer()
        results: list[dict] = []
        interrupted = None
        try:
            run_specs(specs, launcher, progress, results)
        except Interrupted as e:
            if under_torchrun():
                raise
            launcher.abort()  # every rank stopped at once; what finished is still reported below
            interrupted = {"signal": e.name, "cases_finished": len(results), "cases_planned": len(specs)}
        is_rank0 = not under_torchrun() or launcher.rank == 0
        code = exit_code(results) if is_rank0 else 0
        if interrupted:
            code = ExitCode.interrupted(signal.Signals[interrupted["signal"]])
        if is_rank0:
            seed = None
            if seed_mode and not interrupted:
                from tpcheck.seed import seed_payload

                seed = seed_payload(seed_mode, results, seed_world_size)
            report = build_report(results, exit_code=code, seed=seed, interrupted=interrupted)
            if finish_report is not None:
                finish_report(report)
            failed = []  # outputs that could not be written: said at the end, exit 2
            stdout_problem = write_stdout(json.dumps(report["seed"], indent=2) + "\n") if seed else None
            if stdout_problem:
                failed.append(stdout_problem)
            if not args.quiet:
                if results:
                    print_summary(results, sys.stderr)
            else:  # quiet, but never silent about why the exit code is 2
                for r in results:
                    if r["verdict"] in ("invalid", "error"):
                        print(f"tpcheck: error: {r['name']}: {r['summary']}", file=sys.stderr)
            if getattr(args, "print_plan", False):
                text = "".join(f"# {r['name']}\n{r['inferred_plan']}\n" if r.get("inferred_plan")
                               else f"# {r['name']}: no plan inferred (written in the case file, or {r['verdict']})\n"
                               for r in results)
                if problem := write_stdout(text):
                    failed.append(problem)
            if interrupted:
                print(f"tpcheck: interrupted by {interrupted['signal']} after {len(results)} of {len(specs)} "
                      "case(s): every rank was stopped; the reports hold the cases that finished", file=sys.stderr)
            failed += write_outputs(report, {"--json": args.json_path, "--html": args.html_path}, args.quiet)
            if interrupted:  # the signal's exit code stands; a failed output is still said
                for line in failed:
                    print(f"tpcheck: error: {line}", file=sys.stderr)
            else:
                code = exit_after_outputs(failed, code)
        if under_torchrun():
            code = launcher.broadcast_code(code)
        return code
    finally:
        try:
            launcher.close()
        except Interrupted:  # a signal while saying goodbye to healthy ranks: stop them instead
            if hasattr(launcher, "abort"):
                launcher.abort()
            raise


# ------------------------------------------------------------------------------ report


def cmd_report(args: argparse.Namespace) -> int:
    """Read a JSON report, checked against the shipped schema (the first error: exit 2), print its summary
    and optionally render it as HTML."""
    from tpcheck.report.console import print_summary
    from tpcheck.report.output import check_output_path
    from tpcheck.report.schema import SCHEMA, load_schema
    from tpcheck.report.validate import first_error

    check_output_path("--html", args.html_path)
    try:
        with open(args.result) as f:
            report = json.load(f)
    except (OSError, ValueError, RecursionError) as e:
        raise UsageError(f"cannot read the report {args.result!r}: {e}; pass a file from `tpcheck run --json`") \
            from None
    if isinstance(report, dict) and report.get("schema") != SCHEMA:
        raise UsageError(f"{args.result!r} has schema {report.get('schema')!r}, this tpcheck reads {SCHEMA!r}")
    error = first_error(report, load_schema())
    if error:
        raise UsageError(f"{args.result!r} is not a valid {SCHEMA} report: at {error}; pass a file from "
                         "`tpcheck run --json`")
    print_summary(report["cases"], sys.stderr)
    return exit_after_outputs(write_outputs(report, {"--html": args.html_path}, quiet=False), 0)


# ------------------------------------------------------------------------------ new


def cmd_new(args: argparse.Namespace) -> int:
    """Write the shipped case-file template to a new file."""
    from importlib import resources

    path = args.path
    if not path.endswith(".py"):
        raise UsageError(f"{path!r}: a case file is a Python file; give a name ending in .py")
    text = resources.files("tpcheck").joinpath("templates/case.py").read_text().replace("THIS_FILE", path)
    try:
        with open(path, "x") as f:
            f.write(text)
    except FileExistsError:
        raise UsageError(f"{path} exists; tpcheck new never overwrites a file: give a new name") from None
    except OSError as e:
        raise UsageError(f"cannot write {path!r}: {e.strerror or e}") from None
    print(f"wrote {path}; check it with: tpcheck verify {path} --world-size 2 4", file=sys.stderr)
    return 0


# ------------------------------------------------------------------------------ faults


def cmd_faults(args: argparse.Namespace) -> int:
    from tpcheck.faults import CATALOGUE

    rows = [{"name": f.name, "bug_class": f.bug_class, "where": f.where, "expected_stage": f.expected_stage,
             "expected_signature": f.expected_signature, "blocks": list(f.blocks), "world_sizes": list(f.worlds),
             "sequence_parallel": f.sequence_parallel, "dtypes": list(f.dtypes)}
            for f in CATALOGUE.values()]
    if args.json:
        text = json.dumps(rows, indent=2) + "\n"
    else:
        text = "".join(f"{r['name']:<32} [{', '.join(r['blocks'])}] {r['bug_class']}\n{'':<32} injected: "
                       f"{r['where']}; expected: {r['expected_signature']} in {r['expected_stage']}; dtypes: "
                       f"{', '.join(r['dtypes'])}\n" for r in rows)
    problem = write_stdout(text)
    if problem:
        raise UsageError(problem)
    return 0
