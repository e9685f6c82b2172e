"""Starting a ``flowseam`` command as several ranks (``--nproc``), with torchrun's own launcher,
and naming the rank whose failure ended the job. Importing it imports no torch."""

from __future__ import annotations

import os
from typing import Any, Mapping


#: the exit status of a rank that stopped because another rank of its job went away (its
#: collective failed): ``EX_UNAVAILABLE`` of sysexits.h, "a peer it needs is gone". The launcher
#: never names such a rank as the one that failed (:func:`first_failure`).
EXIT_PEER_LOST = 69


def first_failure(failures: Mapping[int, Any]) -> tuple[int, Any]:
    """``(rank, failure)`` of the rank whose failure ended a job, from torchrun's failures
    (rank → ``ProcessFailure``, with ``exitcode``: negative for a signal, and ``timestamp``).

    A rank's death takes the others down with it, and the launcher may see those first: a rank
    whose collective broke exits :data:`EXIT_PEER_LOST` (or aborts, SIGABRT, when gloo does), and
    the launcher stops the rest (SIGTERM, status 143). Those come after every other failure, in
    that order, whatever their timestamps (whole seconds: a dying rank and its peer often share
    one); within a class the earliest, then the lowest rank.
    """
    import signal

    def consequence(failure: Any) -> int:
        code = failure.exitcode
        if code == -signal.SIGABRT:
            return 1
        if code in (EXIT_PEER_LOST, 128 + signal.SIGTERM, -signal.SIGTERM):
            return 2
        return 0

    rank = min(failures, key=lambda r: (consequence(failures[r]), failures[r].timestamp, r))
    return rank, failures[rank]


def launch(argv: list[str], nproc: int) -> int:
    """Run ``python -m flowseam ARGV`` as ``nproc`` ranks on this machine with torchrun's own
    launcher (``torch.distributed.run --standalone``: a free port, one process per rank,
    ``OMP_NUM_THREADS=1`` unless set). When a rank fails, torchrun stops the others (SIGTERM,
    then SIGKILL) before this returns: no rank is left behind.

    :returns: 0, or the exit status of the rank whose failure ended the job
        (:func:`first_failure`; 1 for a rank killed by a signal), after one line naming it;
        ``128 + N`` when this process got signal ``N`` (SIGINT, SIGTERM: torchrun passes it on
        to every rank, then stops them).
    """
    import shutil
    import sys
    import tempfile

    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    logs = tempfile.mkdtemp(prefix="flowseam-ranks-")  # torchrun's error files; removed below
    args = torchrun.get_args_parser().parse_args(
        ["--standalone", f"--nproc-per-node={nproc}", f"--log-dir={logs}", "-m", "flowseam"])
    args.training_script_args = list(argv)  # not parsed by torchrun (--nproc is its prefix)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default, without its notice
    try:
        torchrun.run(args)
    except ChildFailedError as exc:
        rank, failure = first_failure(exc.failures)
        signal = failure.signal_name() if failure.exitcode < 0 else None
        how = f"was killed by {signal}" if signal else f"exited with status {failure.exitcode}"
        print(f"flowseam: rank {rank} of {nproc} {how}; the other ranks were stopped (the "
              "first failure's own message is above)", file=sys.stderr)
        return failure.exitcode if failure.exitcode > 0 else 1
    except SignalException as exc:  # Ctrl-C or SIGTERM: torchrun has passed it to every rank
        return 128 + int(exc.sigval)
    finally:
        shutil.rmtree(logs, ignore_errors=True)
    return 0
