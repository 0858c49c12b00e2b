"""Train any task with any compressor.

One process::

    python -m dgc.train task=fmnist_resnet20 compression=dgc train.max_steps=200

Data parallel on one machine, one process per worker (gloo on CPU, NCCL on GPU); ``--nproc N`` runs
PyTorch's elastic launcher (torchrun's) for you, checks the configuration before any worker starts, and
exits with the workers' status (``--max-restarts K`` restarts crashed workers, which resume)::

    python -m dgc.train --nproc 4 task=cifar10_resnet110 compression=dgc data.root=$HOME/data/cifar10
    torchrun --standalone --nproc_per_node=4 -m dgc.train task=cifar10_resnet110 compression=dgc   # the same

Several nodes: ``launch/slurm/`` (one Slurm task per rank). A sweep, one run after another (never
inside torchrun)::

    python -m dgc.train -m task=fmnist_resnet20 compression=none,topk,dgc

Common overrides: ``run_dir=PATH seed=N train.max_steps=N data.limit=N resume=auto``;
``python -m dgc.train --cfg job`` prints the composed configuration.

Exit status: 0 done; 2 a problem you can fix (the one line printed says which); 3 the run diverged
(non-finite gradients); 4 a collective timed out (a rank stalled or died); 75 stopped on SIGTERM,
SIGUSR1 or SIGINT (Ctrl-C) after a checkpoint (run the same command with ``resume=auto`` to continue); 1 anything else.
Set ``DGC_DEBUG=1`` for tracebacks.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import traceback
from dataclasses import fields, is_dataclass
from typing import NoReturn

from dgc.extras import require

require("repro", "python -m dgc.train", command=__name__ == "__main__")

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from dgc.compressors import COMPRESSORS
from dgc.repro.config import (
    EXIT_DIVERGED,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_STALLED,
    EXIT_USER,
    Config,
    ConfigError,
)

CONFIG_MODULE = "dgc.conf"
GROUPS = ("task", "compression", "logger", "model", "data", "optim")
ConfigStore.instance().store(name="schema", node=Config)
# each compressor's config is the schema of its presets (conf/compression/*.yaml: /schema/compression/<name>)
for _name, _cls in COMPRESSORS.items():
    ConfigStore.instance().store(group="schema/compression", name=_name, node=_cls.config_class)


def _rank() -> int:
    for name in ("RANK", "SLURM_PROCID"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def _fail(message: str, status: int = EXIT_USER, prefix: str = "error") -> NoReturn:
    """One line on stderr (from rank 0 only, so a job prints it once; a rank 0 that dies without a word is
    named by the launcher) and exit ``status``."""
    line = f"{prefix}: {message}"
    if _rank() == 0:
        print(line, file=sys.stderr, flush=True)
    said = os.environ.get(LAUNCH_DIR)
    if said and _world_size() > 1:
        # the --nproc launcher prints another rank's line when rank 0 was stopped before it could say its own
        with contextlib.suppress(OSError):
            with open(os.path.join(said, f"said.{_rank()}"), "w") as f:
                f.write(line)
    if os.environ.get("DGC_DEBUG") and sys.exc_info()[0] is not None:
        traceback.print_exc()
    if _world_size() > 1:
        # a worker of a job: leave without C++ static destructors, where gloo's threads can abort the
        # process ("terminate called without an active exception") after the error was reported
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


def _world_size() -> int:
    for name in ("WORLD_SIZE", "SLURM_NTASKS"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 1


def _valid_keys(path: str, owner: object = None) -> str:
    """The keys valid next to ``path``: of ``owner`` (the dataclass that refused a key) when known."""
    if is_dataclass(owner):
        return ", ".join(f.name for f in fields(owner))
    node: object = Config
    for part in path.split(".")[:-1]:
        kinds = {f.name: f.type for f in fields(node)} if is_dataclass(node) else {}
        if part not in kinds:
            break
        node = {f.name: f.default_factory for f in fields(node)}.get(part)  # type: ignore[arg-type]
        node = node() if callable(node) else node
    return ", ".join(f.name for f in fields(node)) if is_dataclass(node) else ""


def _refuse_added_keys(user: list[str]) -> None:
    """``+key=value`` adds a key the schema does not have (Hydra allows it): a typo, refused."""
    for override in user:
        if override.startswith("+"):
            key = override.lstrip("+").split("=", 1)[0]
            if key.split(".")[0] not in GROUPS or "." in key:
                parent = key.rsplit(".", 1)[0] if "." in key else ""
                valid = _valid_keys(key) if parent else ", ".join(f.name for f in fields(Config))
                _fail(f"{override}: the configuration has no key {key!r} to add (valid keys: {valid})")


def check_syntax(overrides: list[str]) -> None:
    """Every override parses in Hydra's grammar (a sweep's too): else one line naming the one that does not."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    for override in overrides:
        if override.startswith("-") or "=" not in override:  # Hydra's flags and their values (--cfg job)
            continue
        try:
            parser.parse_overrides([override])
        except OverrideParseException as exc:
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            detail = next((line for line in lines[1:] if not line.startswith(("See ", "^"))), "")
            detail = detail.split(" expecting ")[0] if "LexerNoViableAlt" not in detail else ""
            key, _, value = override.partition("=")
            quoted = value.replace("'", "\\'")
            _fail(f"cannot read the override {override!r}" + (f" ({detail})" if detail else "") + "; Hydra reads "
                  f"such a value in quotes, inside the shell's: \"{key}='{quoted}'\"")  # fmt: skip


def precheck(overrides: list[str]) -> Config:
    """Compose a single run's config once up front, so mistakes get one clear line."""
    from hydra import compose, initialize_config_module
    from hydra.errors import ConfigCompositionException, MissingConfigException
    from omegaconf.errors import OmegaConfBaseException

    from dgc.conf import options

    user = [o for o in overrides if not o.startswith(("hydra.", "hydra/", "--", "-"))]
    _refuse_added_keys(user)
    try:
        with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
            return typed(compose("config", overrides=user))
    except MissingConfigException as exc:
        for group in GROUPS:
            for o in user:
                if o.split("=", 1)[0].lstrip("+~") == group and o.split("=", 1)[1] not in options(group):
                    _fail(f"unknown {group} {o.split('=', 1)[1]!r}; valid: {', '.join(options(group))}")
        _fail(str(exc).splitlines()[0])
    except (ConfigCompositionException, OmegaConfBaseException) as exc:
        cause = exc.__cause__ or exc
        message = " ".join(str(cause).split("\n")[0].split())
        key = getattr(cause, "full_key", None) or ""
        valid = _valid_keys(key, getattr(cause, "object_type", None)) if key else ""
        if key and key not in message:
            message = f"{key}: {message}"
        _fail(f"{message}" + (f" (valid keys: {valid})" if valid and "not in" in message else ""))


def typed(cfg: DictConfig) -> Config:
    """The composed config as dataclasses; their checks (``__post_init__``) fail with one line."""
    try:
        return OmegaConf.to_object(cfg)  # type: ignore[return-value]
    except (ValueError, TypeError) as exc:
        _fail(str(exc).splitlines()[0])


def _peer_lost(exc: BaseException) -> bool:
    text = str(exc)
    return any(t in text for t in ("Connection closed by peer", "Connection reset by peer", "Broken pipe"))


def _is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


@hydra.main(version_base="1.3", config_path="pkg://" + CONFIG_MODULE, config_name="config")
def _main(cfg: DictConfig) -> dict | None:
    from dgc.distributed import init_distributed, shutdown
    from dgc.repro import faults
    from dgc.repro.locate import continue_with
    from dgc.repro.trainer import Diverged, Interrupted, Trainer

    config = typed(cfg)
    try:
        callbacks = faults.from_env()
    except ValueError as exc:
        _fail(str(exc))
    try:
        info = init_distributed(config.device, timeout_s=config.timeout_s)
    except ValueError as exc:  # e.g. device=cuda without CUDA
        _fail(str(exc).splitlines()[0])
    trainer = None
    try:
        trainer = Trainer(config, info, callbacks=callbacks)
        summary = trainer.fit()
    except ConfigError as exc:
        shutdown(clean=False)
        _fail(str(exc).splitlines()[0])
    except Interrupted as exc:
        shutdown(clean=False)
        _fail(str(exc), EXIT_INTERRUPTED, prefix="interrupted")
    except Diverged as exc:
        shutdown(clean=False)
        _fail(str(exc), EXIT_DIVERGED)
    except Exception as exc:  # noqa: BLE001 - every other failure: one line, the traceback on request
        shutdown(clean=False)
        if _is_timeout(exc):
            _fail(f"a collective waited longer than timeout_s={config.timeout_s:g} s: a rank stalled or died "
                  f"({type(exc).__name__})", EXIT_STALLED)  # fmt: skip
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        if _peer_lost(exc):
            how = trainer.files.continue_with() if trainer is not None else continue_with(None)
            _fail(f"another rank stopped (gloo: {first.split('] ')[-1]}); to continue from the last checkpoint, "
                  f"{how}", EXIT_ERROR)  # fmt: skip
        if _rank() != 0:  # a failure of this rank alone: say which
            print(f"error: rank {_rank()}: {type(exc).__name__}: {first}", file=sys.stderr, flush=True)
        _fail(f"{type(exc).__name__}: {first} (set DGC_DEBUG=1 for the traceback)", EXIT_ERROR)
    shutdown()
    return summary


#: set by :func:`launch` for its workers: the launcher's PID (a worker dies with it)
LAUNCHER_PID = "DGC_LAUNCHER_PID"
#: the --nproc launcher's folder, where a worker that fails with one line leaves it (``said.<rank>``)
LAUNCH_DIR = "DGC_LAUNCH_DIR"
#: the signals the launcher passes on to its workers (each stops them at a step boundary after a checkpoint)
FORWARDED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1")
_PR_SET_PDEATHSIG = 1


def _die_with_launcher() -> None:
    """In a worker of :func:`launch`: receive SIGTERM when the launcher dies, whatever kills it (``kill -9``
    included), so that the worker checkpoints and exits instead of training on unsupervised, holding the run's
    lock. A launcher already gone by now: exit at once."""
    launcher = os.environ.get(LAUNCHER_PID, "")
    if not launcher.isdigit() or int(launcher) == os.getpid() or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        return  # not fatal: the launcher's own signal handling still stops the workers
    if os.getppid() != int(launcher):  # it died before the prctl
        _fail("the launcher (python -m dgc.train --nproc) exited before this worker started", EXIT_INTERRUPTED)


def _signal_name(code: int) -> str:
    import signal

    try:
        return f"signal {-code} ({signal.Signals(-code).name})"
    except ValueError:
        return f"signal {-code}"


def _say_for_rank_0(folder: str) -> None:
    """When a worker failed with its one line but rank 0, which prints it, was stopped before it failed too (the
    agent stops the others at the first failure), print the line of the lowest rank that left one."""
    lines = {int(n.split(".")[1]): os.path.join(folder, n) for n in os.listdir(folder) if n.startswith("said.")}
    if lines and 0 not in lines:
        with open(lines[min(lines)]) as f:
            print(f.read().strip(), file=sys.stderr, flush=True)


def launch(nproc: int, max_restarts: int, overrides: list[str], run_dir: str | None = None) -> NoReturn:
    """Run ``nproc`` workers on this machine with PyTorch's elastic agent (torchrun's, standalone
    rendezvous on a free port) and exit with their status: one line on errors, no launcher trace.

    The workers die with the launcher (``kill -9`` of it included: :func:`_die_with_launcher`); the signals
    in :data:`FORWARDED` are passed on to them: SIGTERM, SIGINT and SIGUSR1 stop the run at a step boundary
    after a checkpoint (exit 75), SIGHUP and SIGQUIT end it. A worker that fails or is killed is named on the
    launcher's output with its rank and why. ``run_dir``: the run directory the launcher chose for the workers
    (the command gave none), so that restarted workers find the run and the messages can name it."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from dgc.repro.locate import RUN_DIR_CHOSEN, continue_with

    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    os.environ[LAUNCHER_PID] = str(os.getpid())
    if run_dir is not None:
        os.environ[RUN_DIR_CHOSEN] = "1"
        overrides = [*overrides, f"run_dir={run_dir}"]
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    args = [f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}", "--standalone", "--monitor-interval=1"]
    # the agent forwards these to every worker (its default list lacks SIGUSR1, Slurm's warning before the time
    # limit, which would otherwise kill the launcher alone)
    args.append(f"--signals-to-handle={','.join(FORWARDED)}")
    # the agent's files (the workers' error reports) in a folder removed on exit: left to itself it makes
    # /tmp/torchelastic_* and never removes it
    logs = tempfile.TemporaryDirectory(prefix="dgc-launch-")
    os.environ[LAUNCH_DIR] = logs.name
    try:
        run(parse_args([*args, f"--log-dir={logs.name}", "-m", "dgc.train", *overrides]))
    except SignalException:
        # the job was told to stop (SIGTERM, SIGINT...): the agent passed it to the workers, which stopped at
        # a step boundary after a checkpoint and said so
        sys.exit(EXIT_INTERRUPTED)
    except ChildFailedError as exc:
        failures = sorted(exc.failures.values(), key=lambda f: f.local_rank)
        # a worker that ended with one of the statuses README names (2, 3, 4, 75) said why in its line, and the
        # agent then stopped the others: that status is the job's
        said = [
            f.exitcode for f in failures if f.exitcode in (EXIT_USER, EXIT_DIVERGED, EXIT_STALLED, EXIT_INTERRUPTED)
        ]
        if said:
            _say_for_rank_0(logs.name)
            sys.exit(said[0])
        # else a worker killed by a signal (a negative code) could not say anything: name it
        for f in failures:
            if f.exitcode < 0:
                print(f"error: rank {f.local_rank} (pid {f.pid}) was killed by {_signal_name(f.exitcode)}; to "
                      f"continue from the last checkpoint, {continue_with(run_dir)}", file=sys.stderr,
                      flush=True)  # fmt: skip
        sys.exit(EXIT_ERROR)
    finally:
        logs.cleanup()
    sys.exit(0)


def _launcher_options(args: list[str]) -> tuple[int | None, int, list[str]]:
    """``--nproc N`` and ``--max-restarts K`` (also ``--opt=value``), and the remaining arguments."""
    nproc, restarts, rest = None, 0, []
    it = iter(args)
    for arg in it:
        name, _, value = arg.partition("=")
        if name in ("--nproc", "--nproc-per-node", "--max-restarts"):
            value = value or next(it, "")
            if not value.isdigit() or (name != "--max-restarts" and int(value) < 1):
                _fail(f"{name} takes a whole number{' >= 1' if name != '--max-restarts' else ''}, got {value!r}")
            if name == "--max-restarts":
                restarts = int(value)
            else:
                nproc = int(value)
        else:
            rest.append(arg)
    return nproc, restarts, rest


def _check_launcher_plugin(args: list[str]) -> None:
    if any(a.startswith("hydra/launcher=slurm") for a in args):
        import importlib.util

        if importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None:
            _fail(
                "hydra/launcher=slurm needs Hydra's submitit launcher: pip install 'dgc[slurm]' "
                "(in a checkout, make install does)"
            )


def usage() -> str:
    """This module's own help (its launcher flags, examples and exit statuses), printed before Hydra's list of
    configuration groups by ``python -m dgc.train --help``."""
    text = (__doc__ or "").replace("::", ":").replace("``", "`")
    return "usage: python -m dgc.train [--nproc N [--max-restarts K]] [-m] [key=value ...]\n\n" + text.strip() + "\n"


def main() -> None:
    _die_with_launcher()
    if any(a in ("--help", "-h") for a in sys.argv[1:]):
        print(usage(), flush=True)
    nproc, restarts, args = _launcher_options(sys.argv[1:])
    _check_launcher_plugin(args)
    check_syntax(args)
    multirun = any(a in ("-m", "--multirun") for a in args)
    if multirun and nproc:
        _fail(f"--nproc {nproc} with -m: a Hydra multirun runs its points one after another in one process, not on "
              f"{nproc} workers each; run one `python -m dgc.train --nproc {nproc} ...` per point (a shell loop over "
              "the values), or, for a table's rows, python -m dgc.repro.sweep")  # fmt: skip
    if multirun and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        _fail("a Hydra multirun (-m) inside torchrun would run the whole sweep on every rank; sweep outside torchrun: "
              "one torchrun (or python -m dgc.train --nproc N) per point")  # fmt: skip
    cfg = None
    if not multirun and not any(a in ("--help", "-h", "--hydra-help", "--info", "--cfg", "-c") for a in args):
        cfg = precheck(args)
    if nproc:
        run_dir = None
        if cfg is not None and cfg.run_dir is None:  # chosen once here: every worker and every restart shares it
            from dgc.repro.locate import choose_run_dir

            run_dir = choose_run_dir(cfg)
        launch(nproc, restarts, args, run_dir)
    sys.argv = [sys.argv[0], *args]
    _main()
    if _world_size() > 1:
        # every rank passed the final barrier and left the process group; skip the C++ static destructors,
        # where gloo's threads can abort a finished worker ("terminate called without an active exception")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
