"""DALI index files for WebDataset shards (what DALI's ``wds2idx.py`` writes) and the ``index`` CLI.

``datapipe index`` also stores the shards' sample counts (see ``datapipe.tar.counts``).

DALI's ``fn.readers.webdataset`` needs, for each tar, an index (format ``v1.2``): a header line
``v1.2 <num_samples>`` and one line per sample with ``<ext> <data_offset> <size> <member_name>``
for each of its files. Without it DALI scans every tar at start-up. The index is made here
with :mod:`tarfile` in streaming mode, so shards on any fsspec storage can be indexed; a local shard whose
headers are all plain ones (what ``ShardWriter``, webdataset and ``tarfile`` write for short ASCII names) is
indexed from its headers alone (:func:`plain_index_lines`), without reading its data.
"""
from __future__ import annotations

import argparse
import io
import logging
import os
import posixpath
import tarfile
import uuid
from collections.abc import Sequence

from datapipe.storage.urls import redact_text, redact_url
from datapipe.tar.headers import is_meta
from datapipe.words import counted

log = logging.getLogger(__name__)

INDEX_VERSION = "v1.2"


def default_index_path(tar_path: str) -> str:
    """``shard-000000.tar`` -> ``shard-000000.idx`` (next to the shard); other names get ``.idx`` appended."""
    if tar_path.endswith(".tar"):
        return tar_path[: -len(".tar")] + ".idx"
    return tar_path + ".idx"


def _split_name(name: str) -> tuple[str, str]:
    """wds2idx's rule: the extension starts at the first dot of the last path component."""
    dot = name.find(".", name.rfind("/") + 1)
    return name[:dot], name[dot + 1:]


_KINDS = {tarfile.SYMTYPE: "a symbolic link", tarfile.LNKTYPE: "a hard link", tarfile.CHRTYPE: "a character device",
          tarfile.BLKTYPE: "a block device", tarfile.FIFOTYPE: "a FIFO"}


def _refusal(member: tarfile.TarInfo) -> str | None:
    """Why ``member`` cannot be indexed (the words ShardStream uses for sparse members), or None.

    Regular files are indexed and directory entries without data are skipped (as wds2idx does);
    anything else (sparse files, links, devices, FIFOs, directories or unknown types with data)
    has no plain bytes at ``offset_data`` that DALI could read."""
    if member.issparse():
        return f"sparse tar members are not supported (member {member.name!r})"
    if member.isreg() or (member.isdir() and member.size == 0):
        return None
    kind = _KINDS.get(member.type) or ("a directory" if member.isdir() else f"of tar type {member.type!r}")
    return (f"member {member.name!r} is {kind}, not a regular file: DALI's reader would find no data for it "
            "(write the shard from the files' contents, e.g. with datapipe.ShardWriter or `datapipe shard`)")


def index_lines(fileobj, *, size: int | None = None) -> list[str]:
    """The index text (lines without newlines) of the tar stream ``fileobj``, header line first.

    Raises ``ValueError`` naming a member that is not a regular file (sparse, link, device...), whose data
    runs past ``size`` (the shard's length, where known), or a damaged header where ``tarfile`` would stop
    without a word (the samples after it would be left out of the index)."""
    samples = _Samples()
    end = 0  # where the last member's data (padded to a block) ends: the next header, or the end of the archive
    with tarfile.open(fileobj=fileobj, mode="r|") as tar:
        for member in tar:
            end = member.offset_data + -(-member.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
            why = _refusal(member)
            if why is not None:
                raise ValueError(why)
            if not member.isreg() or is_meta(member.name):  # ``__meta__`` members (a member table) hold no sample
                continue
            if size is not None and member.offset_data + member.size > size:
                raise ValueError(f"member {member.name!r} of {member.size} bytes at byte {member.offset_data} runs "
                                 f"past the end of the shard ({size} bytes): the shard is truncated")
            samples.add(member.name, member.offset_data, member.size)
    _check_stopped_at_the_end(fileobj, end, len(samples.samples))
    if not samples.samples:
        raise ValueError("the tar file holds no samples")
    return samples.lines()


class _Samples:
    """Members in file order -> the index's samples: ``__meta__`` members and hidden files (a last path part
    starting with a dot) skipped, as wds2idx skips them; consecutive members of one basename make a sample."""

    def __init__(self):
        self.samples: list[list[str]] = []
        self._last: str | None = None

    def add(self, name: str, offset: int, size: int) -> None:
        basename, ext = _split_name(name)
        if is_meta(name) or not basename or basename.endswith("/"):
            return
        entry = f"{ext} {offset} {size} {name}"
        if basename != self._last:
            self.samples.append([entry])
            self._last = basename
        else:
            self.samples[-1].append(entry)

    def lines(self) -> list[str]:
        return [f"{INDEX_VERSION} {len(self.samples)}"] + [" ".join(sample) for sample in self.samples]


def _check_stopped_at_the_end(fileobj, end: int, samples: int) -> None:
    """A ValueError where the walk stopped at a block that is neither a header it could read nor the end of the
    archive (``tarfile`` stops there silently). Unseekable streams are not checked."""
    try:
        fileobj.seek(end)
        block = fileobj.read(tarfile.BLOCKSIZE)
    except (OSError, io.UnsupportedOperation):
        return
    if block and block.strip(b"\0"):
        raise ValueError(f"the tar cannot be read past byte {end}: the block there is neither a member's header nor "
                         f"the end of the archive (a damaged header; {counted(samples, 'sample')} before it)")


PAX_TIMES = frozenset({b"mtime", b"atime", b"ctime"})  # pax records that change no member's name or size


def _timestamps_only(records: bytes) -> bool:
    """Whether the pax header data ``records`` is well formed (``<length> <key>=<value>\\n`` each, filling it
    exactly) and holds only :data:`PAX_TIMES`."""
    at = 0
    while at < len(records):
        space = records.find(b" ", at)
        if space <= at or not records[at:space].isdigit():
            return False
        end = at + int(records[at:space])
        if end <= space or end > len(records) or records[end - 1:end] != b"\n":
            return False
        if records[space + 1:end - 1].partition(b"=")[0] not in PAX_TIMES:
            return False
        at = end
    return at == len(records) > 0


def plain_index_lines(path: str) -> list[str] | None:
    """:func:`index_lines` of the local shard ``path`` from its headers alone (one 512-byte read each, no data
    read), or None where a header is not a plain one (an extension header for a long name, a link, a directory,
    a damaged header...): then :func:`index_lines` walks it. A pax header that holds only timestamps (webdataset's
    ``TarWriter`` gives every member one) counts as plain."""
    from datapipe.tar.headers import BLOCK, _checksum_ok, _octal, _plain_member, padded

    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        samples = _Samples()
        at = 0
        after_pax = False
        while at + BLOCK <= size:
            header = os.pread(fd, BLOCK, at)
            if not header.strip(b"\0"):
                if after_pax:
                    return None  # a pax header must have a member after it (tarfile refuses the shard)
                break  # the end of the archive
            after_pax = header[156:157] == b"x"
            if after_pax:  # a pax header: only timestamps may pass
                try:
                    length = _octal(header[124:136]) if _checksum_ok(header) else 0
                except ValueError:
                    return None
                if not 0 < length <= 1 << 16 or not _timestamps_only(os.pread(fd, length, at + BLOCK)):
                    return None
                at += BLOCK + padded(length)
                if at > size:
                    return None  # cut inside it
                continue
            member = _plain_member(header, at, size)
            if member is None:
                return None
            name, value_size, _ = member
            if name.endswith("/"):
                return None  # tarfile takes such a member for a directory
            data, at = at + BLOCK, at + BLOCK + padded(value_size)
            if at > size:
                return None  # cut inside the value's last block: the walk reads whole blocks
            samples.add(name, data, value_size)
        else:  # no end-of-archive block: what is left must be zeros (a part of a header is damage to the walk)
            if after_pax or (at < size and os.pread(fd, size - at, at).strip(b"\0")):
                return None
        return samples.lines() if samples.samples else None
    finally:
        os.close(fd)


def first_incomplete(index_files: list[str], exts: list[str]) -> tuple[int, str, list[str]] | None:
    """The first sample, in DALI index files, that lacks an entry DALI's reader asks for: ``(shard number, key,
    the missing entries)``, each of ``exts`` a ``;``-separated set of alternatives (``"jpg;png"``, ``"cls"``)."""
    wanted = [set(e.split(";")) for e in exts]
    for shard, index_file in enumerate(index_files):
        try:
            with open(index_file, encoding="utf-8") as f:
                lines = f.read().splitlines()[1:]  # the header line first
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            have = set(fields[0::4])  # <ext> <offset> <size> <member name>, per entry
            missing = [e for e, w in zip(exts, wanted) if not w & have]
            if missing and len(fields) >= 4:
                return shard, _split_name(fields[3])[0], missing
    return None


def write_dali_index(tar_path_or_url: str, index_path: str | None = None, *, storage_options: dict | None = None) -> str:
    """Write the DALI index of one shard (local path or fsspec URL); returns the index path.

    ``index_path`` defaults to :func:`default_index_path`. Written under a temporary name and
    renamed, so a reader never sees half an index. Raises :class:`datapipe.errors.DataError`
    when the shard is unreadable, not a tar or empty.
    """
    import fsspec

    from datapipe.errors import DataError
    from datapipe.storage.urls import is_local, local_path

    index_path = index_path or default_index_path(tar_path_or_url)
    options = storage_options or {}
    head = b""
    try:
        lines = plain_index_lines(local_path(tar_path_or_url)) if is_local(tar_path_or_url) else None
        if lines is None:
            with fsspec.open(tar_path_or_url, "rb", **options) as f:
                size = getattr(f, "size", None)
                head = f.read(512)
                f.seek(0)
                lines = index_lines(f, size=size if isinstance(size, int) else None)
    except (OSError, tarfile.TarError, ValueError, EOFError) as e:
        from datapipe.tar.headers import is_tar_header, looks_like

        why = str(e) if not head or is_tar_header(head) else f"not a tar file: {looks_like(head)}"
        if head.startswith(b"\x1f\x8b"):
            why += " (DALI's reader and its index need uncompressed tars)"
        raise DataError(f"cannot index shard: {why}", url=redact_url(tar_path_or_url)) from e
    fs, path = fsspec.core.url_to_fs(index_path, **options)
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    parent = posixpath.dirname(path)
    if parent:
        fs.makedirs(parent, exist_ok=True)
    with fs.open(tmp, "w") as out:
        out.write("\n".join(lines) + "\n")
    fs.mv(tmp, path)
    return index_path


def index_command(paths: Sequence[str], *, index_dir: str | None = None, skip_existing: bool = False,
                  counts: bool = True) -> int:
    """Index every shard in ``paths`` (brace patterns expanded); returns a CLI exit code (0 ok, 1 failures).

    ``index_dir`` puts the index files into that directory (``<name>.idx``) instead of next to
    the shards; ``skip_existing`` leaves existing index files alone. ``counts`` also stores the
    shards' sample counts (``datapipe.tar.counts``: beside the shards, else in the local count cache),
    so that ``ShardStream`` over shards without a manifest does not count them again.
    """
    import fsspec

    from datapipe.errors import DataError
    from datapipe.storage.urls import expand_urls

    try:
        urls = [u for p in paths for u in expand_urls(p)]
    except (ValueError, DataError) as e:
        log.error("%s", e)
        return 1
    if not urls:
        log.error("no shards given")
        return 1
    if index_dir is not None:
        fs, p = fsspec.core.url_to_fs(index_dir)
        if fs.exists(p) and not fs.isdir(p):
            log.error("--index-dir %s is a file, not a directory: give a directory (it is created if missing)",
                      redact_url(index_dir))
            return 2
    failed = 0
    for url in urls:
        target = default_index_path(url)
        if index_dir is not None:
            target = posixpath.join(index_dir, posixpath.basename(target))
        if skip_existing:
            fs, p = fsspec.core.url_to_fs(target)
            if fs.exists(p):
                log.info("exists: %s", redact_url(target))
                continue
        try:
            write_dali_index(url, target)
            log.info("indexed %s -> %s", redact_url(url), redact_url(target))
        except DataError as e:
            log.error("%s", e)
            failed += 1
        except OSError as e:
            log.error("cannot write the index %s: %s", redact_url(target), redact_text(e))
            failed += 1
    if failed:
        log.error("%s could not be indexed", f"{failed} of {counted(len(urls), 'shard')}" if len(urls) > 1 else "the shard")
        return 1
    if counts:
        from datapipe.tar.counts import count_and_store

        try:
            entries = count_and_store(urls)
        except DataError as e:
            log.error("%s", e)
            return 1
        damaged = [u for u, e in entries.items() if e["damage"]]
        for url in damaged:
            log.error("%s (%s)", entries[url]["damage"], redact_url(url))
        log.info("stored the sample counts of %s (%s): streams over them no longer count them",
                 counted(len(entries), "shard"), counted(sum(e["count"] for e in entries.values()), "sample"))
        return 1 if damaged else 0
    return 0


def configure_parser(p: argparse.ArgumentParser) -> None:
    """``datapipe index SHARDS... [--index-dir DIR] [--skip-existing]`` (see datapipe.cli)."""
    p.add_argument("shards", nargs="+", metavar="SHARDS", help="shard paths or URLs; brace ranges allowed")
    p.add_argument("--index-dir", default=None, help="write index files here instead of next to the shards")
    p.add_argument("--skip-existing", action="store_true", help="keep index files that already exist")
    p.add_argument("--no-counts", dest="counts", action="store_false",
                   help="do not store the sample counts (.datapipe-counts.json) that ShardStream reads")


def run_command(args: argparse.Namespace) -> int:
    return index_command(args.shards, index_dir=args.index_dir, skip_existing=args.skip_existing,
                         counts=args.counts)
