"""What a bundle carries beside the model: PAYLOAD_KINDS, one entry per kind, read by every other place.

An entry names the kind's tar prefix, the `mm bundle` option that names what to carry, the `mm unbundle`
option that names where it goes (and the default directory under DEST.payload/), and the class of its
index records. The class knows the rest: how to collect the files to carry, how to check a record read
from a (hostile) index, the files expected at the destination, the restore hint written in RESTORE.txt and
the next command printed after unbundle. Adding a kind = one record class + one PAYLOAD_KINDS entry.

Index form (under "payloads" in every volume's index): {kind.index_key: record | null} for a kind that
carries one item, {kind.index_key: [record, ...]} for a kind that carries several.
"""
from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Callable, NamedTuple

from ..errors import BadInput
from ..fsutil import check_relpath
from .fields import integer, plain_name, record, string

MODEL_KIND = "model"  # the model's own files: not a payload, but members of the same index
MODEL_PREFIX = "model"
PAYLOAD_ROOT = "payload"  # under the restore directory of RESTORE.txt
PAYLOAD_PARTIAL = ".mm-partial"  # partial files of an unfinished import, under each payload kind's root


class PayloadFile(NamedTuple):
    """One file to carry: PATH under the kind's root (at the destination and in the tar), read from SRC."""

    path: str
    src: Path
    size: int


class Collected(NamedTuple):
    """What a kind's collect() found: index records, files to carry, notes for the user."""

    records: tuple
    files: tuple[PayloadFile, ...]
    notes: tuple[str, ...] = ()


# --- the container image: one `docker save` archive ---------------------------------------------

class ImagePayload(NamedTuple):
    file: str
    size: int
    refs: tuple[str, ...]
    image_id: str | None

    def files(self) -> list[tuple[str, int]]:
        return [(self.file, self.size)]

    def to_index(self) -> dict:
        return {"file": self.file, "size": self.size, "refs": list(self.refs), "image_id": self.image_id}

    def summary(self) -> dict:
        return self.to_index()

    def placed(self, root: Path) -> dict:
        return {**self.to_index(), "path": str(root / self.file)}

    def next_command(self, root: Path) -> str:
        return f"docker load -i {root / self.file}"

    def restore_hint(self, restored: str) -> str:
        return f"Container image {', '.join(self.refs) or self.image_id}: docker load -i {restored}/{self.file}"

    @classmethod
    def parse(cls, raw: object, where: str) -> ImagePayload:
        raw = record(raw, "image record")
        file = plain_name(raw, "file", where, "image file")
        refs = raw.get("refs", [])
        if not isinstance(refs, list) or not all(isinstance(r, str) for r in refs):
            raise ValueError("image refs are not a list of strings")
        image_id = raw.get("image_id")
        if image_id is not None and not isinstance(image_id, str):
            raise ValueError("image_id is not a string")
        return cls(file, integer(raw, "size"), tuple(refs), image_id)

    @classmethod
    def collect(cls, paths: list[Path], cache_key: dict | None) -> Collected:
        records, files = [], []
        for image in map(Path, paths):
            if not image.is_file():
                raise BadInput(f"{image}: no such image archive")
            records.append(image_info(image))
            files.append(PayloadFile(image.name, image, image.stat().st_size))
        return Collected(tuple(records), tuple(files))


def image_info(image: Path) -> ImagePayload:
    """The references a `docker save` archive holds (manifest.json RepoTags, index.json names) and its config."""
    import tarfile  # here: the CLI imports this table at start-up

    refs: list[str] = []
    image_id = None
    try:
        with tarfile.open(image, "r:") as tf:
            names = {m.name: m for m in tf.getmembers() if m.isreg()}
            if "manifest.json" in names:
                for entry in json.load(tf.extractfile(names["manifest.json"])):
                    refs += [t for t in entry.get("RepoTags") or [] if t not in refs]
                    config = str(entry.get("Config", ""))
                    image_id = image_id or "sha256:" + config.rsplit("/", 1)[-1].removesuffix(".json")
            if "index.json" in names:
                for m in json.load(tf.extractfile(names["index.json"])).get("manifests", []):
                    ann = m.get("annotations") or {}
                    ref = ann.get("io.containerd.image.name") or ann.get("org.opencontainers.image.ref.name")
                    if ref and ref not in refs:
                        refs.append(ref)
            if "manifest.json" not in names and "index.json" not in names:
                raise BadInput(f"{image}: not a `docker save` archive (no manifest.json or index.json inside)")
    except (tarfile.TarError, OSError, ValueError, AttributeError) as e:
        raise BadInput(f"{image}: cannot read the image archive ({e})") from None
    return ImagePayload(image.name, image.stat().st_size, tuple(refs), image_id)


# --- kernel caches: directories of compiled kernels, each with its key ---------------------------

class KernelCachePayload(NamedTuple):
    label: str
    key: dict | None
    entries: tuple[tuple[str, int], ...]  # (path under the cache, size); "files" in the index

    def files(self) -> list[tuple[str, int]]:
        return [(f"{self.label}/{rel}", size) for rel, size in self.entries]

    def to_index(self) -> dict:
        return {"label": self.label, "key": self.key, "files": [[rel, size] for rel, size in self.entries]}

    def summary(self) -> dict:
        return {"label": self.label, "key": self.key, "files": len(self.entries)}

    def placed(self, root: Path) -> dict:
        return {**self.summary(), "path": str(root / self.label)}

    def _key_text(self) -> str:
        return json.dumps(self.key) if self.key else "unkeyed"

    def next_command(self, root: Path) -> str:
        return (f"docker run ... -v {root / self.label}:/root/.cache/{self.label} ...   "
                f"# kernel cache {self.label}, key {self._key_text()}")

    def restore_hint(self, restored: str) -> str:
        return (f"Kernel cache {self.label} (key: {self._key_text()}): mount {restored}/{self.label} into the "
                f"container, e.g. -v \"$PWD/{restored}/{self.label}:/root/.cache/{self.label}\"")

    @classmethod
    def parse(cls, raw: object, where: str) -> KernelCachePayload:
        raw = record(raw, "kernel cache record")
        label = plain_name(raw, "label", where, "kernel cache label")
        files = raw["files"]
        if not isinstance(files, list):
            raise ValueError(f"kernel cache {label!r}: files is not a list")
        entries = []
        for item in files:
            if not isinstance(item, list) or len(item) != 2:
                raise ValueError(f"kernel cache {label!r}: file record {item!r} is not [path, size]")
            rel = check_relpath(string({"path": item[0]}, "path"), where)
            entries.append((rel, integer({"size": item[1]}, "size")))
        from ..cachekey import check_cache_key  # here: the CLI imports this table at start-up

        return cls(label, check_cache_key(raw.get("key"), label), tuple(entries))

    @classmethod
    def collect(cls, paths: list[Path], cache_key: dict | None) -> Collected:
        records, files, notes = [], [], []
        labels: Counter = Counter()
        for cache in map(Path, paths):
            label = cache.resolve().name or "kernel-cache"
            labels[label] += 1
            label = label if labels[label] == 1 else f"{label}-{labels[label]}"
            record, found = _kernel_cache(cache, label, cache_key)
            if record.key is None:
                notes.append(f"kernel cache {cache} has no mm-cache-key.json and no --cache-key: bundled as unkeyed")
            records.append(record)
            files += found
        return Collected(tuple(records), tuple(files), tuple(notes))


def _kernel_cache(cache_dir: Path, label: str, cli_key: dict | None) -> tuple[KernelCachePayload, list[PayloadFile]]:
    if not cache_dir.is_dir():
        raise BadInput(f"{cache_dir}: kernel cache is not a directory")
    from ..cachekey import read_cache_key  # here: the CLI imports this table at start-up

    key = read_cache_key(cache_dir) or (dict(cli_key) if cli_key else None)
    found = []
    for dirpath, dirnames, filenames in os.walk(cache_dir):
        dirnames.sort()
        for name in sorted(filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]):
            p = Path(dirpath, name)
            rel = p.relative_to(cache_dir).as_posix()
            if p.is_symlink() or not p.is_file():
                raise BadInput(f"{p}: kernel cache holds a symlink or special file; only regular files can be bundled")
            check_relpath(f"{label}/{rel}", str(cache_dir))
            found.append(PayloadFile(f"{label}/{rel}", p, p.stat().st_size))
    return KernelCachePayload(label, key, tuple((f.path.split("/", 1)[1], f.size) for f in found)), found


# --- the table ------------------------------------------------------------------------------------

class PayloadKind(NamedTuple):
    kind: str  # the "kind" of its members in the index
    index_key: str  # its key under the index's "payloads"
    many: bool  # several records (a list in the index) or at most one (a record or null)
    record: type  # parse / collect / files / to_index / summary / placed / next_command / restore_hint
    source_option: str  # `mm bundle` option naming what to carry
    source_help: str
    dest_option: str  # `mm unbundle` option naming where it goes
    dest_default: str  # directory under DEST.payload/ when dest_option is not given
    dest_help: str

    @property
    def prefix(self) -> str:
        """Tar prefix of its members, also its place under RESTORE.txt's ./restore directory."""
        return f"{PAYLOAD_ROOT}/{self.dest_default}"

    @property
    def source_param(self) -> str:
        return self.source_option.lstrip("-").replace("-", "_")

    @property
    def dest_param(self) -> str:
        return self.dest_option.lstrip("-").replace("-", "_")


PAYLOAD_KINDS: tuple[PayloadKind, ...] = (
    PayloadKind("image", "image", False, ImagePayload,
                "--image", "A `docker save` archive to carry along.",
                "--image-dest", "image", "Where the image archive goes. Default: DEST.payload/image."),
    PayloadKind("kernel-cache", "kernel_caches", True, KernelCachePayload,
                "--kernel-cache", "A kernel-cache directory to carry (repeatable). Its key comes from "
                                  "mm-cache-key.json inside it.",
                "--cache-dest", "kernel-cache",
                "Where kernel caches go (one directory per cache). Default: DEST.payload/kernel-cache."),
)
BY_KIND = {k.kind: k for k in PAYLOAD_KINDS}
PREFIXES = {MODEL_KIND: MODEL_PREFIX, **{k.kind: k.prefix for k in PAYLOAD_KINDS}}  # tar prefix by member kind

Payloads = dict  # kind -> tuple of records, for every kind of PAYLOAD_KINDS


def collect_payloads(sources: dict[str, list[Path]], cache_key: dict | None) -> tuple[Payloads, list[tuple[str, PayloadFile]], list[str]]:
    """From `mm bundle`'s payload options (kind -> paths): the records, and (kind, file) to carry, and notes."""
    unknown = set(sources) - set(BY_KIND)
    if unknown:
        raise BadInput(f"unknown payload kind(s): {', '.join(sorted(unknown))}")
    records: Payloads = {}
    files: list[tuple[str, PayloadFile]] = []
    notes: list[str] = []
    for k in PAYLOAD_KINDS:
        got = k.record.collect(list(sources.get(k.kind) or ()), cache_key)
        if not k.many and len(got.records) > 1:
            raise BadInput(f"{k.source_option} can be given once")
        records[k.kind] = got.records
        files += [(k.kind, f) for f in got.files]
        notes += got.notes
    return records, files, notes


def parse_payloads(raw: object, where: str) -> Payloads:
    """The index's "payloads" object, checked (ValueError/BadInput on anything off)."""
    if not isinstance(raw, dict):
        raise ValueError("payloads is not an object")
    out: Payloads = {}
    for k in PAYLOAD_KINDS:
        value = raw.get(k.index_key, [] if k.many else None)
        if k.many:
            if not isinstance(value, list):
                raise ValueError(f"payloads.{k.index_key} is not a list")
            out[k.kind] = tuple(k.record.parse(v, where) for v in value)
        else:
            out[k.kind] = () if value is None else (k.record.parse(value, where),)
    return out


def _by_index_key(payloads: Payloads, render: Callable[[PayloadKind, object], object]) -> dict:
    """Payloads in the index's shape, each record rendered by RENDER(kind, record)."""
    doc: dict = {}
    for k in PAYLOAD_KINDS:
        items = [render(k, r) for r in payloads.get(k.kind, ())]
        doc[k.index_key] = items if k.many else (items[0] if items else None)
    return doc


def payloads_document(payloads: Payloads, render: str = "to_index") -> dict:
    """Payloads as the index holds them (or in another per-record rendering without arguments: summary)."""
    return _by_index_key(payloads, lambda k, r: getattr(r, render)())


def payloads_placed(payloads: Payloads, roots: dict[str, Path]) -> dict:
    """Payloads as unbundle placed them: each record with its path at the destination."""
    return _by_index_key(payloads, lambda k, r: r.placed(roots[k.kind]))


def next_commands(payloads: Payloads, roots: dict[str, Path]) -> list[str]:
    return [r.next_command(roots[k.kind]) for k in PAYLOAD_KINDS for r in payloads.get(k.kind, ())]


def restore_hints(payloads: Payloads, restored: str = "restore") -> list[str]:
    return [r.restore_hint(f"{restored}/{k.prefix}") for k in PAYLOAD_KINDS for r in payloads.get(k.kind, ())]


def files_expected(payloads: Payloads) -> dict[tuple[str, str], int]:
    """(kind, path under the kind's root) -> size, for every payload file."""
    return {(k.kind, path): size for k in PAYLOAD_KINDS for r in payloads.get(k.kind, ()) for path, size in r.files()}


def payload_roots(dest: Path, chosen: dict[str, Path | None] | None) -> dict[str, Path]:
    """Where each kind goes: the option given, else DEST.payload/<dest_default>."""
    chosen = chosen or {}
    beside = dest.parent / f"{dest.name}.payload"
    return {k.kind: Path(chosen.get(k.kind) or beside / k.dest_default) for k in PAYLOAD_KINDS}
