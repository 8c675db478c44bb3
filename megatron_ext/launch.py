"""torchrun for our entry scripts, with one line per mistake: ``python -m megatron_ext.launch <torchrun's options>
finetune_qwen.py <flags>`` (what examples/_launch.sh runs on every node).

torchrun itself (its elastic agent, in this process), with what a newcomer needs around it:
- The flags are checked once, in one process, before any rank starts: a bad flag or a missing file is the entry
  script's own one line in about 2 s, exit 2, instead of every rank starting first. A second node that would wait
  for itself (NNODES > 1, NODE_RANK > 0, MASTER_ADDR unset or loopback) is refused in one line.
- When a rank fails, the first failing rank's one line is printed, not torchrun's traceback: exit 2 for bad input
  (a rank's ``ConfigError``), 1 for a failure. Each rank writes that line to a file of ours (``STATUS_DIR``) instead
  of printing it, so it appears once; a rank's own traceback, when it has one, stays above it.
- SIGTERM and SIGUSR1 go to every rank, which finishes its step, saves and exits 0; this process then exits 0 too
  (torchrun exits 1 after a SIGTERM whatever its ranks did). Ranks still running SHUTDOWN_TIMEOUT seconds later
  (``--shutdown-timeout``) are killed, exit 1. Under this launcher a rank ignores SIGUSR1 until its training loop
  handles it, so an early USR1 (Slurm's ``--signal``) cannot kill it.
``python finetune_qwen.py`` and ``torchrun ... finetune_qwen.py`` keep working without it.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import List, Optional

from megatron_ext.cli import STATUS_DIR  # set for the ranks: where each writes how it failed (cli.run_main)
from megatron_ext.errors import PREFLIGHT  # set for the single-process check: arguments.parse stops after its checks

ENTRY_SCRIPTS = ("finetune_qwen.py", "pretrain_gpt.py", "pretrain_vit.py", "verify_model.py")  # what the check runs
LOOPBACK = ("127.", "localhost", "::1", "0.0.0.0")
NAME = "megatron_ext.launch"


def _statuses(folder: str) -> dict:
    statuses = {}
    for path in glob.glob(os.path.join(folder, "rank*.json")):
        with open(path) as f:
            status = json.load(f)
        statuses[status["rank"]] = status
    return statuses


def first_failure(failures: dict, statuses: dict) -> str:
    """The line that explains a failed run, from torchrun's ``{rank: ProcessFailure}`` and the ranks' own lines:
    bad input first; then a rank that ended without a word of ours (killed, crashed: the others' failed
    collectives follow from it); then the earliest line."""
    bad_input = [s for s in statuses.values() if s["code"] == 2]
    silent = sorted(r for r, f in failures.items() if r not in statuses and f.exitcode != -signal.SIGTERM)
    if bad_input or not silent and statuses:
        status = min(bad_input or statuses.values(), key=lambda s: (s["time"], s["rank"]))
        line = status["line"]
        return line if line.startswith(f"rank {status['rank']}") else f"rank {status['rank']}: {line}"
    rank = silent[0] if silent else min(failures)
    code = failures[rank].exitcode
    how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
    return f"rank {rank} ended ({how}) without a word of ours; its output is above"


def _fail(message: str, code: int) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return code


def _node0_here(addr: str, port: int) -> bool:
    """Node 0 of this job runs on this machine (several "nodes" on one host): its rendezvous port is open, or its
    launcher process is starting."""
    import socket

    import psutil

    try:
        socket.create_connection((addr, port), 1).close()
        return True
    except OSError:
        pass

    def value(argv, flag):  # torchrun takes --node-rank and --node_rank alike
        names = (flag, "--" + flag[2:].replace("-", "_"))
        at = next((i for i, a in enumerate(argv) if a in names), None)
        return argv[at + 1] if at is not None and at + 1 < len(argv) else None

    for process in psutil.process_iter(["cmdline"]):
        argv = process.info["cmdline"] or []
        if (process.pid != os.getpid() and NAME in argv and value(argv, "--node-rank") == "0"
                and value(argv, "--master-port") == str(port)):
            return True
    return False


def _check_nodes(args, max_nodes: int) -> Optional[str]:
    """A node other than the first whose MASTER_ADDR is unset or loopback would wait forever for a rendezvous on
    itself, unless node 0 runs on this very machine."""
    node_rank = int(args.node_rank)
    addr = args.master_addr or "127.0.0.1"
    if max_nodes == 1 or node_rank == 0 or not addr.startswith(LOOPBACK):
        return None
    if _node0_here(addr, int(args.master_port or 29500)):
        return None
    return (f"NNODES={max_nodes} NODE_RANK={node_rank} with MASTER_ADDR={args.master_addr or '(unset)'}: node 0 is "
            "not on this machine, so this node would wait for a rendezvous on itself; set MASTER_ADDR to node 0's "
            "address (the same on every node)")


def preflight(script: str, script_args: List[str], world_size: int, nproc: int, node_rank: int) -> int:
    """The entry script's own checks (arguments.parse) in one process that stands for rank 0 of the whole world."""
    if os.path.basename(script) not in ENTRY_SCRIPTS:
        return 0
    env = dict(os.environ, WORLD_SIZE=str(world_size), RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE=str(nproc),
               GROUP_RANK=str(node_rank), **{PREFLIGHT: "1"})
    env.pop(STATUS_DIR, None)
    return subprocess.run([sys.executable, script, *script_args], env=env).returncode


class _Signals:
    """SIGTERM/SIGUSR1 to this process: passed to every rank, and after ``grace`` seconds the ranks left are killed."""

    def __init__(self, grace: float):
        self.grace, self.received, self.killed = grace, None, False

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _ranks(self):
        import psutil

        return psutil.Process().children()

    def _handle(self, signum, frame) -> None:
        for rank in self._ranks():
            try:
                rank.send_signal(signum)
            except Exception:  # psutil.NoSuchProcess: it just ended
                pass
        if self.received is None:
            self.received = signal.Signals(signum).name
            threading.Thread(target=self._kill_late, daemon=True, name="megatron_ext-grace").start()

    def _kill_late(self) -> None:
        time.sleep(self.grace)
        ranks = self._ranks()
        if ranks:
            self.killed = True
            print(f"error: {len(ranks)} rank(s) still running {self.grace:.0f} s after {self.received} "
                  f"(SHUTDOWN_TIMEOUT, --shutdown-timeout): killed, their save is not committed; raise it to the "
                  "time a save takes", file=sys.stderr, flush=True)
            for rank in ranks:
                try:
                    rank.kill()
                except Exception:
                    pass


def _torchrun_defaults(args):
    """What torchrun's ``run()`` settles before it launches: --standalone, or one node with no port given, rendezvous
    on a free local port; else MASTER_PORT 29500."""
    import uuid

    from torch.distributed.run import parse_min_max_nnodes

    one_node = args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None \
        and parse_min_max_nnodes(args.nnodes)[1] == 1
    if args.standalone or one_node:
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    return args


def main(argv: Optional[List[str]] = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    args = _torchrun_defaults(parse_args(sys.argv[1:] if argv is None else argv))
    # torchrun's own default for its ranks, which it announces in a banner when the variable is unset
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    config, cmd, cmd_args = config_from_args(args)
    problem = _check_nodes(args, config.max_nodes)
    if problem:
        return _fail(problem, 2)
    code = preflight(args.training_script, args.training_script_args, config.max_nodes * config.nproc_per_node,
                     config.nproc_per_node, int(args.node_rank))
    if code:
        return code
    logging.disable(logging.ERROR)  # the agent's own lines; what they say is said below, once
    config.signals_to_handle = "SIGINT,SIGHUP,SIGQUIT"  # SIGTERM and SIGUSR1 are ours (_Signals)
    grace = args.shutdown_timeout or float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", 30))
    signals = _Signals(grace)
    signals.install()
    script = os.path.basename(args.training_script)
    with tempfile.TemporaryDirectory(prefix="megatron_ext-ranks-") as folder:
        os.environ[STATUS_DIR] = folder
        try:
            elastic_launch(config=config, entrypoint=cmd)(*cmd_args)
            return 0
        except ChildFailedError as e:
            if signals.killed:
                return 1
            statuses = _statuses(folder)
            code = 2 if any(s["code"] == 2 for s in statuses.values()) else 1
            return _fail(f"{script}: {first_failure(e.failures, statuses)}", code)
        except SignalException as e:
            return 128 + int(e.sigval)
        except Exception as e:  # the rendezvous: a node missing, the port taken
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            return _fail(f"torchrun on {args.master_addr}:{args.master_port} (MASTER_ADDR:MASTER_PORT): "
                         f"{type(e).__name__}: {first}", 1)


if __name__ == "__main__":
    sys.exit(main())
