"""Pack a device check's results folder into what the device tool brings back.

The tool returns at most 8 files from $OUT (16 MiB each, at most 2 folders down, names of letters,
digits, '.', '_', '-'); anything else is dropped without saying which. So: the summary files named
with --keep are copied as they are, and every other file under the results folder (each step's log,
whatever a new step writes) goes into ONE tar.gz; logs too large for the archive's budget keep their
first and last lines. Standard library only (the device machines have no package registry).

  python bench/pack_results.py RESULTS OUT --keep gpu_check.json,gpu_check.md --archive gpu_check_logs.tar.gz
"""
from __future__ import annotations

import argparse
import io
import os
import re
import sys
import tarfile

MAX_FILES = 8
MAX_BYTES = 16 << 20
MAX_DEPTH = 2  # folders below $OUT
NAME = re.compile(r"^[A-Za-z0-9._-]+$")
ARCHIVE_BUDGET = 15 << 20  # compressed; a margin below MAX_BYTES


def returned_files(out: str) -> list[str]:
    """Every file under ``out``, as paths relative to it."""
    found = []
    for root, _dirs, files in os.walk(out):
        for name in files:
            found.append(os.path.relpath(os.path.join(root, name), out))
    return sorted(found)


def problems(out: str) -> list[str]:
    """What the device tool would drop from ``out`` (empty when everything comes back)."""
    files = returned_files(out)
    found = []
    if len(files) > MAX_FILES:
        found.append(f"{len(files)} files (at most {MAX_FILES} come back)")
    for rel in files:
        parts = rel.split(os.sep)
        if len(parts) - 1 > MAX_DEPTH:
            found.append(f"{rel}: {len(parts) - 1} folders down (at most {MAX_DEPTH})")
        if not all(NAME.match(p) for p in parts):
            found.append(f"{rel}: a name outside letters, digits, '.', '_', '-'")
        size = os.path.getsize(os.path.join(out, rel))
        if size > MAX_BYTES:
            found.append(f"{rel}: {size} bytes (at most {MAX_BYTES})")
    return found


def _clipped(data: bytes, keep: int) -> bytes:
    """The first and last ``keep // 2`` bytes of ``data`` (cut at line ends), with a marker between."""
    if len(data) <= keep:
        return data
    head = data[:keep // 2].rsplit(b"\n", 1)[0]
    tail = data[-(keep // 2):].split(b"\n", 1)[-1]
    return head + b"\n[... %d bytes cut by pack_results.py ...]\n" % (len(data) - len(head) - len(tail)) + tail


def _archive(results: str, members: list[str], per_file: int | None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for rel in members:
            with open(os.path.join(results, rel), "rb") as f:
                data = f.read()
            if per_file is not None:
                data = _clipped(data, per_file)
            info = tarfile.TarInfo(rel)
            info.size = len(data)
            info.mtime = int(os.path.getmtime(os.path.join(results, rel)))
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def pack(results: str, out: str, keep: list[str], archive: str) -> list[str]:
    """Copy ``keep`` from ``results`` to ``out`` and archive the rest there; returns the files in ``out``."""
    os.makedirs(out, exist_ok=True)
    for name in keep:
        src = os.path.join(results, name)
        if os.path.isfile(src):
            with open(src, "rb") as f:
                data = f.read()
            with open(os.path.join(out, name), "wb") as f:
                f.write(_clipped(data, MAX_BYTES - 4096))
    members = [rel for rel in returned_files(results) if rel not in keep]
    blob = _archive(results, members, None)
    per_file = 8 << 20
    while len(blob) > ARCHIVE_BUDGET and per_file > 4096:  # shrink the largest logs until it fits
        blob = _archive(results, members, per_file)
        per_file //= 2
    with open(os.path.join(out, archive), "wb") as f:
        f.write(blob)
    return returned_files(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results")
    ap.add_argument("out")
    ap.add_argument("--keep", default="", help="comma-separated file names copied as they are")
    ap.add_argument("--archive", required=True, help="the tar.gz holding every other file")
    args = ap.parse_args()
    keep = [k for k in args.keep.split(",") if k]
    files = pack(args.results, args.out, keep, args.archive)
    for rel in files:
        print(f"  {rel} ({os.path.getsize(os.path.join(args.out, rel))} bytes)")
    bad = problems(args.out)
    for p in bad:
        print(f"!!! {p}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
