"""Where `--config` comes from: a YAML file, or a stream that a job system pipes (Kubernetes, Slurm, CI): `-`
(standard input), /dev/stdin, /proc/self/fd/N, a FIFO. Either is read once, bounded in size, and a stream also in
idle time, so a wrong file, a stuck writer or a terminal is one error line instead of a hang or a huge read."""

from __future__ import annotations

import io
import os
import select
import stat
import sys
from dataclasses import dataclass

from soma_cluster.errors import SomaError

MAX_CONFIG_BYTES = 1 << 20  # 1 MiB: a config holds settings (a preset is about 1 KB); more is not a config
IDLE_S = 60.0  # seconds a stream may give nothing (no byte, no end) before its writer is taken as stuck or absent
STDIN = "-"
STDIN_LABEL = "--config - (standard input)"
_CHUNK = 1 << 16
_STDIN_PATHS = ("/dev/stdin", "/dev/fd/0", "/proc/self/fd/0")
_FIX = "pipe the YAML in (cat FILE.yaml | soma prepare CAMPAIGN --config -) or pass the file (--config FILE.yaml)"


@dataclass(frozen=True)
class ConfigText:
    raw: bytes
    label: str  # how an error names it: "config file PATH" or "--config - (standard input)"


def read_config(arg: str, idle_s: float = IDLE_S) -> ConfigText:
    """The bytes of --config ARG: a regular file, or standard input / a FIFO / a character device read to its
    end. SomaError (one line naming it and the fix) for anything else, or more than MAX_CONFIG_BYTES."""
    if not arg.strip():
        raise SomaError("--config is empty; pass a YAML file of settings, - for standard input, or leave it out")
    if arg == STDIN:
        return ConfigText(_read_stdin(idle_s), STDIN_LABEL)
    label = f"config file {arg}"
    try:
        mode = os.stat(arg).st_mode
    except (FileNotFoundError, NotADirectoryError):
        if arg in _STDIN_PATHS:  # their link is gone: descriptor 0 is closed (<&-)
            raise SomaError(f"{label}: standard input is closed; {_FIX}") from None
        raise SomaError(f"config file {arg!r} not found; pass an existing YAML file (- reads standard input)") from None
    except OSError as exc:
        raise SomaError(f"{label} cannot be read ({exc.strerror}); fix its permissions or pass another") from None
    if stat.S_ISDIR(mode):
        raise SomaError(f"{label} is a directory; pass a YAML file in it (or - for standard input)")
    if stat.S_ISREG(mode):
        return ConfigText(_read_file(arg, label), label)
    if stat.S_ISFIFO(mode) or stat.S_ISCHR(mode):  # a pipe (/dev/stdin, /proc/self/fd/N, <(...)), a FIFO, /dev/tty
        return ConfigText(_read_stream_path(arg, label, idle_s), label)
    if stat.S_ISSOCK(mode):  # a service manager's stdin: readable as descriptor 0, not by its name
        raise SomaError(f"{label} is a socket, which cannot be opened by name; read it with --config - instead")
    raise SomaError(f"{label} is not a regular file, a pipe or a FIFO; pass a YAML file")


def _too_big(label: str, size: str) -> SomaError:
    return SomaError(
        f"{label} holds {size}, more than the {MAX_CONFIG_BYTES >> 20} MiB a config may; a config holds settings "
        f"only (a preset is about 1 KB): {_FIX}"
    )


def _read_file(path: str, label: str) -> bytes:
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)  # bounded even if the file grows after the stat
    except OSError as exc:
        raise SomaError(f"{label} cannot be read ({exc.strerror}); fix its permissions or pass another") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise _too_big(label, f"{os.path.getsize(path):,} bytes")
    return raw


def _read_stdin(idle_s: float) -> bytes:
    stream = sys.stdin
    if stream is None:  # started with standard input closed (<&-): Python leaves sys.stdin None
        raise SomaError(f"{STDIN_LABEL}: standard input is closed; {_FIX}")
    try:
        fd = stream.fileno()
    except (OSError, ValueError, io.UnsupportedOperation):  # an in-memory stdin (typer's test runner): no descriptor
        raw = stream.buffer.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise _too_big(STDIN_LABEL, f"over {MAX_CONFIG_BYTES:,} bytes") from None
        return raw
    try:
        os.fstat(fd)
    except OSError:
        raise SomaError(f"{STDIN_LABEL}: standard input is closed; {_FIX}") from None
    if os.isatty(fd):
        raise SomaError(f"{STDIN_LABEL}: standard input is a terminal, so nothing is piped to read; {_FIX}")
    return _read_stream(fd, STDIN_LABEL, idle_s)


def _read_stream_path(path: str, label: str, idle_s: float) -> bytes:
    try:  # O_NONBLOCK: opening a FIFO that no writer has opened yet returns at once (poll then waits, bounded)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise SomaError(f"{label} cannot be opened ({exc.strerror}); {_FIX}") from None
    try:
        if os.isatty(fd):
            raise SomaError(f"{label} is a terminal, so nothing is piped to read; {_FIX}")
        return _read_stream(fd, label, idle_s)
    finally:
        os.close(fd)


def _read_stream(fd: int, label: str, idle_s: float) -> bytes:
    """A stream to its end, at most MAX_CONFIG_BYTES; SomaError when it gives nothing for idle_s seconds."""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    chunks, size = [], 0
    while True:
        if not poller.poll(idle_s * 1000):
            raise SomaError(
                f"{label}: nothing arrived for {idle_s:g} s ({size:,} bytes read, no end of input); the writer is "
                f"stuck or never came (a FIFO needs one): write the YAML and close it, or pass a file"
            )
        try:
            chunk = os.read(fd, _CHUNK)
        except BlockingIOError:  # woken with nothing to read yet (a FIFO opened O_NONBLOCK)
            continue
        except OSError as exc:
            raise SomaError(f"{label} cannot be read ({exc.strerror}); {_FIX}") from None
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_CONFIG_BYTES:  # stop reading: the rest of a huge stream is never taken in
            raise _too_big(label, f"over {MAX_CONFIG_BYTES:,} bytes")
