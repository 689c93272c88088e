"""Logs that can be followed from a Slurm output file: every line says which rank on which host wrote it.

:func:`setup` replaces ``sys.stdout``/``sys.stderr`` with line-buffered writers that put
``[rank R host H]`` before every line (prints, logging, warnings, tracebacks), and points the
logging handlers of already imported libraries at them. Output written by C code (NCCL) bypasses
Python and keeps its own prefix.
"""

from __future__ import annotations

import contextlib
import faulthandler
import io
import logging
import os
import socket
import sys
import threading
from collections.abc import Iterator
from typing import TextIO

log = logging.getLogger("ctrain.train")

#: How long a rank whose results are on disk may take to close its process group and exit. Under
#: load a gloo thread can stay blocked in teardown; the launcher's exit barrier on the other nodes
#: would then wait its full 300 s and report a run that finished as failed.
SHUTDOWN_SECONDS = 60


def rank_from_env() -> int:
    """This process's global rank from the launcher's environment (0 for a plain process)."""
    for name in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def world_size_from_env() -> int:
    """How many processes the launcher started (1 for a plain process)."""
    value = os.environ.get("WORLD_SIZE", "")
    return int(value) if value.isdigit() else 1


def prefix_for(rank: int) -> str:
    return f"[rank {rank} host {socket.gethostname().split('.')[0]}] "


class PrefixedWriter(io.TextIOBase):
    """A text stream that writes ``prefix`` at the start of each line and flushes at each line end.

    A carriage return also starts a line, so progress bars keep the prefix as they redraw.
    """

    def __init__(self, stream: TextIO, prefix: str) -> None:
        self._stream = stream
        self.prefix = prefix
        self._at_line_start = True

    def write(self, text: str) -> int:
        if not isinstance(text, str):  # click probes streams with b"" to tell text from binary ones
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        if not text:
            return 0
        out = []
        for piece in text.splitlines(keepends=True):
            if self._at_line_start and piece not in ("\n", "\r"):
                out.append(self.prefix)
            out.append(piece)
            self._at_line_start = piece.endswith(("\n", "\r"))
        self._stream.write("".join(out))
        if "\n" in text or "\r" in text:
            self._stream.flush()
        return len(text)

    def write_marked(self, mark: str, text: str) -> None:
        """Write a line that starts with ``mark``, then the prefix (``error: [rank 0 host h] ...``): tools
        and people look for the mark at the start of the line."""
        if not self._at_line_start:
            self._stream.write("\n")
        self._stream.write(f"{mark}{self.prefix}{text.rstrip(chr(10))}\n")
        self._at_line_start = True
        self._stream.flush()

    def flush(self) -> None:
        self._stream.flush()

    def isatty(self) -> bool:
        return self._stream.isatty()

    def fileno(self) -> int:
        return self._stream.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._stream, "encoding", "utf-8")

    def writable(self) -> bool:
        return True


def _underlying(stream: object) -> object:
    return stream._stream if isinstance(stream, PrefixedWriter) else stream


def rebind_handlers() -> None:
    """Point every logging StreamHandler that writes to the real stdout/stderr at the prefixed writers."""
    targets = {id(sys.__stdout__): sys.stdout, id(sys.__stderr__): sys.stderr}
    loggers = [logging.getLogger()] + [
        logger for logger in logging.root.manager.loggerDict.values() if isinstance(logger, logging.Logger)
    ]
    for logger in loggers:
        for handler in logger.handlers:
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                target = targets.get(id(_underlying(handler.stream)))
                if target is not None and handler.stream is not target:
                    handler.setStream(target)
                    # transformers swaps in the stream's flush at import; keep flushing the right one.
                    handler.flush = target.flush  # type: ignore[method-assign]


def setup(rank: int | None = None, prefix: bool = True) -> None:
    """Prefix this process's output with its rank and host, and send ctrain's log lines there."""
    rank = rank_from_env() if rank is None else rank
    if prefix:
        text = prefix_for(rank)
        for name in ("stdout", "stderr"):
            current = getattr(sys, name)
            if isinstance(current, PrefixedWriter):
                current.prefix = text
            else:
                setattr(sys, name, PrefixedWriter(current, text))
    logging.captureWarnings(True)
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S"))
        log.addHandler(handler)
        log.propagate = False
    log.setLevel(logging.INFO)
    warnings_logger = logging.getLogger("py.warnings")
    if not warnings_logger.handlers:
        warnings_logger.addHandler(logging.StreamHandler(sys.stderr))
        warnings_logger.propagate = False
    rebind_handlers()


def quiet_libraries() -> None:
    """Library logging at warning level (their info lines repeat what ctrain prints); progress bars only
    on a terminal (in a batch job's log file each redraw is another line)."""
    import datasets
    import huggingface_hub.utils
    import transformers

    transformers.logging.set_verbosity_warning()
    datasets.logging.set_verbosity_warning()
    if not sys.stderr.isatty():
        transformers.logging.disable_progress_bar()
        huggingface_hub.utils.disable_progress_bars()
        datasets.disable_progress_bars()
    for name in ("DeepSpeed", "deepspeed", "torch.distributed", "accelerate"):
        logging.getLogger(name).setLevel(logging.WARNING)
    rebind_handlers()


@contextlib.contextmanager
def deadline(what: str, code: int, seconds: float = SHUTDOWN_SECONDS) -> Iterator[None]:
    """Run the block; if it is still running after SECONDS, print every thread's stack and exit with CODE.

    Only for shutdown work after a rank's results are on disk (closing the process group, atexit
    handlers), where a stuck C++ thread must not turn a finished run into a hung one.
    """

    def expire() -> None:
        sys.stderr.write(f"ctrain: {what} has not finished after {seconds:g} s; this rank's work is on disk, "
                         f"so it exits now with {code} (where each thread was:)\n")  # fmt: skip
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
        os._exit(code)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


#: What must not be freed before the process ends (:func:`keep_until_exit`).
_KEPT: list[object] = []


def keep_until_exit(*objects: object) -> None:
    """Keep OBJECTS (a trainer, an exception and its frames) alive until the process ends.

    Freeing a DDP model frees its reducer and with it the last reference to gloo's process group,
    whose destructor joins gloo's worker threads while holding the GIL; a worker that is just
    freeing a finished collective's tensors needs the GIL for that, and both wait for ever (seen in
    CI: a 2-process run hung after it had finished, at the return from ``run``). ``ctrain train``
    ends through ``os._exit`` (:func:`exit_process`, :func:`exit_at_shutdown`), so what is kept
    here is never freed at all.
    """
    _KEPT.extend(objects)


def exit_at_shutdown(code: int) -> None:
    """End the process with CODE from an atexit handler, once the error has been reported, skipping
    the interpreter's teardown (which would free what :func:`keep_until_exit` kept)."""
    import atexit

    def end() -> None:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(code)

    atexit.register(end)


def exit_process(code: int) -> None:
    """Exit with CODE once Python's own exit work is done, skipping the C++ teardown after it.

    Even with the process group destroyed, a thread that torch's C++ side started (gloo, the
    store client) can still be joinable when static destructors run; the process then aborts
    with SIGABRT and a finished run is reported as failed. Everything a run leaves is on disk by
    now, so atexit handlers (loggers, trackers) run and streams flush, then the process ends.
    """
    import atexit

    with deadline("running the exit handlers", code):
        atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
