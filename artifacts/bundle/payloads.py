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

from ..errors import BadInput, MMError
from ..paths import payload_dir
from ..edges.fsutil import check_relpath, open_local_file
from .fields import MAX_TEXT, integer, plain_name, record, string

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
    """What a kind's collect() found: index records, files to carry, notes for the user, and files written
    beside the volumes too (install-mm.sh: run from the first disk's directory)."""

    records: tuple
    files: tuple[PayloadFile, ...]
    notes: tuple[str, ...] = ()
    beside: tuple[PayloadFile, ...] = ()


class CollectOptions(NamedTuple):
    """`mm bundle`'s options that say how to collect payloads (each kind reads the ones it needs)."""

    cache_key: dict | None = None  # for kernel caches without mm-cache-key.json
    image_ref: str | None = None  # the pinned image an archive must be (default: the pin's)
    allow_other_image: bool = False
    tls_verify: bool = True  # registry TLS when the image chain is resolved on a connected host


# --- the container image: one `docker save` archive, proven to be the pinned image ------------------

class ImagePayload(NamedTuple):
    file: str
    size: int
    refs: tuple[str, ...]
    image_id: str | None
    pinned: str | None = None  # the reference the archive was checked against
    proven: bool = False  # its config digest is the one the pinned reference gives (else carried with --allow-other-image)
    record: str | None = None  # the `mm image save` record carried beside it (FILE.mm-image.json): launch reads it
    record_size: int = 0

    def files(self) -> list[tuple[str, int]]:
        return [(self.file, self.size)] + ([(self.record, self.record_size)] if self.record else [])

    def to_index(self) -> dict:
        return {"file": self.file, "size": self.size, "refs": list(self.refs), "image_id": self.image_id,
                "pinned": self.pinned, "proven": self.proven, "record": self.record, "record_size": self.record_size}

    def summary(self) -> dict:
        return self.to_index()

    def placed(self, root: Path) -> dict:
        return {**self.to_index(), "path": str(root / self.file)}

    def next_command(self, root: Path) -> str:
        load = f"docker load -i {root / self.file}"
        if not self.proven:
            return f"{load}   # NOT proven to be the pinned image {self.pinned or ''} (--allow-other-image)".rstrip()
        if not self.image_id:
            return load
        return f"{load} && docker image inspect --format '{{{{.Id}}}}' {self.image_id}   # the loaded ID: the pinned {self.pinned}"

    def restore_hint(self, restored: str) -> str:
        other = "" if self.proven else " (NOT proven to be the pinned image: bundled with --allow-other-image)"
        check = f"; then docker image inspect {self.image_id} must succeed" if self.image_id else ""
        return (f"Container image {', '.join(self.refs) or self.image_id}{other}: docker load -i "
                f"{restored}/{self.file}{check}")

    @classmethod
    def parse(cls, raw: object, where: str) -> ImagePayload:
        raw = record(raw, "image record")
        file = plain_name(raw, "file", where, "image file")
        refs = raw.get("refs", [])
        if not isinstance(refs, list) or not all(isinstance(r, str) and len(r) <= MAX_TEXT for r in refs):
            raise ValueError(f"image refs are not a list of strings (of at most {MAX_TEXT} characters)")
        image_id, pinned, rec = raw.get("image_id"), raw.get("pinned"), raw.get("record")
        for key, value in (("image_id", image_id), ("pinned", pinned)):
            if value is not None and (not isinstance(value, str) or len(value) > MAX_TEXT):
                raise ValueError(f"image {key} is not a string of at most {MAX_TEXT} characters")
        if not isinstance(raw.get("proven", False), bool):
            raise ValueError("image proven is not true or false")
        if rec is not None:
            rec = plain_name(raw, "record", where, "image record file")
            if rec != file + _IMAGE_RECORD_SUFFIX:
                raise ValueError(f"image record {rec!r} is not {file + _IMAGE_RECORD_SUFFIX!r}")
        return cls(file, integer(raw, "size"), tuple(refs), image_id, pinned, bool(raw.get("proven", False)),
                   rec, integer(raw, "record_size") if rec else 0)

    @classmethod
    def collect(cls, paths: list[Path], opts: CollectOptions) -> Collected:
        records, files, notes = [], [], []
        for image in map(Path, paths):
            if not image.is_file():
                raise BadInput(f"{image}: no such image archive")
            rec, carried, note = prove_image(image, opts)
            records.append(rec)
            files += carried
            notes += note
        return Collected(tuple(records), tuple(files), tuple(notes))


_IMAGE_RECORD_SUFFIX = ".mm-image.json"  # image.RECORD_SUFFIX (image.py is imported only when an image is carried)


def prove_image(archive: Path, opts: CollectOptions) -> tuple[ImagePayload, list[PayloadFile], list[str]]:
    """The archive's record, proven against the pinned reference (image.prove_archive): the config digest inside
    must be the one the chain gives (from the registry when it answers, else from the `mm image save` record
    beside it). Another image is refused (exit 7) unless opts.allow_other_image. The record travels with it."""
    from ..serving import image as mm_image  # here: the CLI imports this table at start-up
    from ..errors import Refused
    from ..pins import default_pin

    ref = opts.image_ref or default_pin().image
    info = image_info(archive)
    notes: list[str] = []
    rec_path = mm_image.record_path(archive)
    proof = None
    if not opts.allow_other_image or rec_path.is_file():  # another image allowed: no registry, only its record
        try:
            proof = mm_image.prove_archive(archive, ref, tls_verify=opts.tls_verify,
                                           registry=not opts.allow_other_image)
        except (BadInput, Refused) as e:
            if not opts.allow_other_image:
                raise
            notes.append(f"{archive}: not proven to be {ref} ({e.message}); carried because of --allow-other-image")
    else:
        notes.append(f"{archive}: not checked against {ref} (--allow-other-image, no {rec_path.name} beside it); "
                     f"the bundle and the start script say it is not proven")
    if proof is not None and not proof.proven:
        if not opts.allow_other_image:
            raise Refused(f"{proof.detail}; pass the archive of {ref} (mm image save --out FILE), or "
                          f"--allow-other-image to carry it anyway")
        notes.append(f"{proof.detail}; carried because of --allow-other-image (the bundle and the start script say so)")
    if proof is not None and proof.proven and not rec_path.is_file():
        mm_image.write_record_for(archive, proof)  # resolved from the registry: launch needs the record offline
    image_id = proof.config if proof is not None and proof.proven else (info.image_id)
    files = [PayloadFile(archive.name, archive, archive.stat().st_size)]
    record_name, record_size = None, 0
    if rec_path.is_file():
        record_name, record_size = rec_path.name, rec_path.stat().st_size
        files.append(PayloadFile(record_name, rec_path, record_size))
    rec = ImagePayload(archive.name, archive.stat().st_size, info.refs, image_id, ref,
                       bool(proof is not None and proof.proven), record_name, record_size)
    return rec, files, notes


MAX_IMAGE_JSON = 16 * 1024 * 1024  # manifest.json / index.json inside a `docker save` archive


def image_info(image: Path) -> ImagePayload:
    """The references a `docker save` archive holds (manifest.json RepoTags, index.json names) and its config.

    Both documents are hostile (an archive from anywhere): read through the untrusted loader, every field typed."""
    import tarfile  # here: the CLI imports this table at start-up

    from ..edges.untrusted import At

    refs: list[str] = []
    image_id = None
    try:
        with open_local_file(image, what="image archive") as raw, tarfile.open(fileobj=raw, mode="r:") as tf:
            names = {m.name: m for m in tf.getmembers() if m.isreg()}
            if "manifest.json" in names:
                at = At(f"{image}: manifest.json")
                for n, entry in enumerate(at.list(_member_json(tf, names["manifest.json"], at.where))):
                    e_at = at.index(n)
                    e_at.obj(entry)
                    for j, tag in enumerate(e_at.get_list(entry, "RepoTags", [])):
                        tag = e_at.key("RepoTags").index(j).str(tag, 1024)
                        if tag not in refs:
                            refs.append(tag)
                    config = e_at.get_str(entry, "Config", "", max_len=1024)
                    image_id = image_id or "sha256:" + config.rsplit("/", 1)[-1].removesuffix(".json")
            if "index.json" in names:
                at = At(f"{image}: index.json")
                index = at.obj(_member_json(tf, names["index.json"], at.where))
                for n, m in enumerate(at.get_list(index, "manifests", [])):
                    m_at = at.key("manifests").index(n)
                    ann = m_at.get_obj(m_at.obj(m), "annotations", {})
                    ref = ann.get("io.containerd.image.name") or ann.get("org.opencontainers.image.ref.name")
                    if ref is not None:
                        m_at.key("annotations").str(ref, 1024)
                    if ref and ref not in refs:
                        refs.append(ref)
            if "manifest.json" not in names and "index.json" not in names:
                raise BadInput(f"{image}: not a `docker save` archive (no manifest.json or index.json inside)")
    except (tarfile.TarError, OSError, EOFError) as e:
        raise BadInput(f"{image}: cannot read the image archive ({e})") from None
    return ImagePayload(image.name, image.stat().st_size, tuple(refs), image_id)


def _member_json(tf, info, where: str) -> object:
    from ..edges.untrusted import load_json

    if info.size > MAX_IMAGE_JSON:
        raise BadInput(f"{where}: {info.size} bytes, more than the {MAX_IMAGE_JSON} allowed")
    member = tf.extractfile(info)
    return load_json(member.read() if member else b"", where, max_bytes=MAX_IMAGE_JSON)


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
        from ..serving.cachekey import check_cache_key  # here: the CLI imports this table at start-up

        return cls(label, check_cache_key(raw.get("key"), label), tuple(entries))

    @classmethod
    def collect(cls, paths: list[Path], opts: CollectOptions) -> Collected:
        cache_key = opts.cache_key
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
    from ..serving.cachekey import read_cache_key  # here: the CLI imports this table at start-up

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


# --- mm itself: install-mm.sh and the wheelhouse (wheelhouse.py), whole in volume 1 ------------------

class MmPayload(NamedTuple):
    mm_version: str
    sets: tuple[str, ...]  # linux-<machine>-cp<XY>
    entries: tuple[tuple[str, int], ...]  # (path under payload/mm, size), install-mm.sh first

    def files(self) -> list[tuple[str, int]]:
        return list(self.entries)

    def to_index(self) -> dict:
        return {"mm_version": self.mm_version, "sets": list(self.sets), "files": [[p, n] for p, n in self.entries]}

    def summary(self) -> dict:
        return {"mm_version": self.mm_version, "sets": list(self.sets), "files": len(self.entries),
                "bytes": sum(n for _, n in self.entries), "install": "sh install-mm.sh [DIR]"}

    def placed(self, root: Path) -> dict:
        return {**self.summary(), "path": str(root), "install": f"sh {root / 'install-mm.sh'} [DIR]"}

    def next_command(self, root: Path) -> str:
        from .wheelhouse import mm_version  # here: the CLI imports this table at start-up
        try:
            running = mm_version()
        except MMError:
            running = None
        if running == self.mm_version:  # it would install the mm that just ran
            return (f"sh {root / 'install-mm.sh'} [DIR]   # only on another host (copy {root}): mm "
                    f"{self.mm_version} is the mm running here")
        return (f"sh {root / 'install-mm.sh'} [DIR]   # mm {self.mm_version} offline, sets {', '.join(self.sets)} "
                f"(on another host: copy {root})")

    def restore_hint(self, restored: str) -> str:
        return (f"mm {self.mm_version} itself (wheel sets {', '.join(self.sets)}): sh install-mm.sh beside the volumes, "
                f"or sh {restored}/install-mm.sh [DIR]; needs only sh and python3")

    @classmethod
    def parse(cls, raw: object, where: str) -> MmPayload:
        raw = record(raw, "mm record")
        sets = raw.get("sets")
        if not isinstance(sets, list) or not all(isinstance(x, str) and plain_name({"set": x}, "set", where, "set")
                                                 for x in sets):
            raise ValueError("mm sets are not a list of names")
        files = raw.get("files")
        if not isinstance(files, list):
            raise ValueError("mm files is not a list")
        entries = []
        for item in files:
            if not isinstance(item, list) or len(item) != 2:
                raise ValueError(f"mm file record {item!r} is not [path, size]")
            entries.append((check_relpath(string({"path": item[0]}, "path"), where), integer({"size": item[1]}, "size")))
        return cls(string(raw, "mm_version"), tuple(sets), tuple(entries))

    @classmethod
    def collect(cls, paths: list[Path], opts: CollectOptions) -> Collected:
        if not paths:
            return Collected((), ())
        from .wheelhouse import INSTALL_SCRIPT, payload_files  # here: the CLI imports this table at start-up

        doc, found = payload_files(Path(paths[0]))
        files = tuple(PayloadFile(rel, src, size) for rel, src, size in found)
        rec = cls(doc["mm_version"], tuple(doc["sets"]), tuple((f.path, f.size) for f in files))
        script = next(f for f in files if f.path == INSTALL_SCRIPT)
        return Collected((rec,), files, beside=(script,))


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
    first_volume: bool = False  # travels whole in volume 1 (placed first, never split; bundle refuses a smaller volume)
    label: str = ""  # what the plan calls it, beside the model's own files

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
    PayloadKind("mm", "mm", False, MmPayload,
                "--wheelhouse", "A directory from `mm bundle --only-mm --out DIR` (install-mm.sh + wheelhouse/) to carry "
                                "instead of building one (mm bundle builds one by default; --no-mm leaves mm out).",
                "--mm-dest", "mm", "Where mm's installer and wheelhouse go. Default: DEST.payload/mm.",
                first_volume=True, label="mm itself (installer and wheels)"),
    PayloadKind("image", "image", False, ImagePayload,
                "--image", "A `docker save` archive to carry along.",
                "--image-dest", "image", "Where the image archive goes. Default: DEST.payload/image.",
                label="engine image"),
    PayloadKind("kernel-cache", "kernel_caches", True, KernelCachePayload,
                "--kernel-cache", "A kernel-cache directory to carry (repeatable). Its key comes from "
                                  "mm-cache-key.json inside it.",
                "--cache-dest", "kernel-cache",
                "Where kernel caches go (one directory per cache). Default: DEST.payload/kernel-cache.",
                label="kernel caches"),
)
BY_KIND = {k.kind: k for k in PAYLOAD_KINDS}
PREFIXES = {MODEL_KIND: MODEL_PREFIX, **{k.kind: k.prefix for k in PAYLOAD_KINDS}}  # tar prefix by member kind

Payloads = dict  # kind -> tuple of records, for every kind of PAYLOAD_KINDS


def collect_payloads(sources: dict[str, list[Path]], opts: CollectOptions
                     ) -> tuple[Payloads, list[tuple[str, PayloadFile]], list[str], list[PayloadFile]]:
    """From `mm bundle`'s payload options (kind -> paths): the records, (kind, file) to carry, notes, and the
    files to write beside the volumes."""
    unknown = set(sources) - set(BY_KIND)
    if unknown:
        raise BadInput(f"unknown payload kind(s): {', '.join(sorted(unknown))}")
    records: Payloads = {}
    files: list[tuple[str, PayloadFile]] = []
    notes: list[str] = []
    beside: list[PayloadFile] = []
    for k in PAYLOAD_KINDS:
        paths = list(sources.get(k.kind) or ())
        if not k.many and len(paths) > 1:
            raise BadInput(f"{k.source_option} can be given once")
        got = k.record.collect(paths, opts)
        records[k.kind] = got.records
        files += [(k.kind, f) for f in got.files]
        notes += got.notes
        beside += got.beside
    return records, files, notes, beside


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
    beside = payload_dir(dest)
    return {k.kind: Path(chosen.get(k.kind) or beside / k.dest_default) for k in PAYLOAD_KINDS}
