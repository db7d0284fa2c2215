"""Pack a device check's results folder into what the device tool brings back.

The tool returns at most 8 files from $OUT (16 MiB each, at most 2 folders down, names of letters,
digits, '.', '_', '-'); anything else is dropped without saying which. So: the summary files named
with --keep are copied as they are (those present, in that order, as many as fit beside the archive), and
every other file under the results folder (each step's log, whatever a new step writes) goes into ONE tar.gz;
logs too large for the archive's budget keep their first and last lines. Standard library only (the device
machines have no package registry).

Back here, ``--record FILES_AT`` puts a call's returned files (the device tool's files_at folder) into the
results folder its step table names (``folder``: gpu_check_<gpu>_<date>) under bench/results/ (--into): the
kept files and the archive's members, and the step table as one more call of that folder's
(``{"calls": [...]}`` in the JSON, a section per call in the Markdown), so that a check's two calls make one
folder. A file of the same name and other content is kept beside the first as NAME.callN.EXT.

  python bench/pack_results.py RESULTS OUT --keep gpu_check.json,gpu_check.md --archive gpu_check_logs.tar.gz
  python bench/pack_results.py --record /work/.device/.../files_at            # into bench/results/<folder>/
"""
from __future__ import annotations

import argparse
import io
import json
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
    """Copy the files of ``keep`` present in ``results`` to ``out`` (the first MAX_FILES - 1 of them) and archive
    every other file there; returns the files in ``out``."""
    os.makedirs(out, exist_ok=True)
    kept = [name for name in keep if os.path.isfile(os.path.join(results, name))][:MAX_FILES - 1]
    for name in kept:
        with open(os.path.join(results, name), "rb") as f:
            data = f.read()
        with open(os.path.join(out, name), "wb") as f:
            f.write(_clipped(data, MAX_BYTES - 4096))
    members = [rel for rel in returned_files(results) if rel not in kept]
    blob = _archive(results, members, None)
    per_file = 8 << 20
    while len(blob) > ARCHIVE_BUDGET and per_file > 4096:  # shrink the largest logs until it fits
        blob = _archive(results, members, per_file)
        per_file //= 2
    with open(os.path.join(out, archive), "wb") as f:
        f.write(blob)
    return returned_files(out)


STEP_TABLES = ("gpu_check", "npu_check")  # NAME.json / NAME.md: a device check's step table


def _put(dest: str, rel: str, data: bytes, call: int) -> str:
    """Write ``data`` at dest/rel, or beside a different file of that name as NAME.callN.EXT; returns the path."""
    path = os.path.join(dest, rel)
    if os.path.exists(path):
        with open(path, "rb") as f:
            if f.read() == data:
                return path
        stem, ext = os.path.splitext(path)
        path = f"{stem}.call{call}{ext}"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return path


def record(files_at: str, into: str) -> str:
    """Put one call's returned files into INTO/<folder>/ (the step table's ``folder``); returns that folder."""
    table = next((t for t in STEP_TABLES if os.path.isfile(os.path.join(files_at, t + ".json"))), None)
    if table is None:
        raise SystemExit(f"{files_at}: no {' or '.join(t + '.json' for t in STEP_TABLES)} (not a device check's files)")
    with open(os.path.join(files_at, table + ".json")) as f:
        steps = json.load(f)
    folder = steps.get("folder")
    if not folder or not NAME.match(folder) or folder in (".", ".."):
        raise SystemExit(f"{table}.json names no results folder (a check before issue 51?): {folder!r}")
    dest = os.path.join(into, folder)
    os.makedirs(dest, exist_ok=True)
    json_path, md_path = os.path.join(dest, table + ".json"), os.path.join(dest, table + ".md")
    calls = []
    if os.path.isfile(json_path):
        with open(json_path) as f:
            old = json.load(f)
        calls = old.get("calls", [old])
    calls.append(steps)
    call = len(calls)
    for name in returned_files(files_at):
        if name in (table + ".json", table + ".md"):
            continue
        src = os.path.join(files_at, name)
        if name.endswith(".tar.gz"):
            with tarfile.open(src) as tar:
                for member in tar.getmembers():
                    parts = member.name.split("/")
                    if not member.isfile() or member.name.startswith("/") or ".." in parts:
                        continue  # (the packer writes plain relative files only)
                    _put(dest, member.name, tar.extractfile(member).read(), call)
        else:
            with open(src, "rb") as f:
                _put(dest, name, f.read(), call)
    with open(json_path, "w") as f:
        json.dump({"calls": calls}, f, indent=1)
    with open(os.path.join(files_at, table + ".md")) as f:
        table_md = f.read()
    previous = ""
    if os.path.isfile(md_path):
        with open(md_path) as f:
            previous = f.read()
        if call == 2 and not previous.startswith("## call 1"):
            previous = f"## call 1 (steps {calls[0].get('steps', '?')})\n\n" + previous
    with open(md_path, "w") as f:
        section = f"## call {call} (steps {steps.get('steps', '?')})\n\n" if call > 1 else ""
        f.write(previous + ("\n" if previous else "") + section + table_md)
    return dest


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="?")
    ap.add_argument("out", nargs="?")
    ap.add_argument("--keep", default="", help="comma-separated file names copied as they are")
    ap.add_argument("--archive", help="the tar.gz holding every other file")
    ap.add_argument("--record", metavar="FILES_AT", help="record a call's returned files under --into")
    ap.add_argument("--into", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()
    if args.record:
        print(f"recorded in {record(args.record, args.into)}")
        return 0
    if not (args.results and args.out and args.archive):
        ap.error("RESULTS OUT --archive NAME (or --record FILES_AT)")
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
