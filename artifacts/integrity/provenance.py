"""Where a model directory's bytes came from, when a bundle brought them: the import in progress
(DIR/.mm/unbundle/state.json) or the one that finished (DIR/.mm/imported.json), both written by `mm unbundle`.

What it is for: advice. On an air-gapped host the remedy for a missing or changed file is the bundle's volumes, not
the Hub, so verify, the quick-verify gate and repair ask `import_remedy` first. Nothing is decided on these files:
read as hostile, anything that does not parse means "no advice from here".
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from ..edges.untrusted import At
from ..edges.fsutil import read_json_file
from ..errors import BadInput
from ..paths import IMPORT_RECORD, UNBUNDLE_STATE

MAX_VOLUMES = 10**6  # a bound on a hostile count, far above any bundle (mm's own margin)


@dataclass(frozen=True)
class ImportStatus:
    """The bundle imported into a directory: in progress (volumes still to come) or complete."""

    name: str
    volumes: int
    done: tuple[int, ...]
    read_from: dict[int, str]  # volume number -> the volume file it was read from
    volume_files: tuple[str, ...]  # each volume's file name, in order (empty when the import did not keep them)
    complete: bool

    @property
    def missing(self) -> list[int]:
        return sorted(set(range(1, self.volumes + 1)) - set(self.done))

    def places_read(self) -> list[str]:
        """The folders the volumes were read from, in volume order, each once."""
        return list(dict.fromkeys(str(Path(p).parent) for _, p in sorted(self.read_from.items())))


def import_status(model_dir: Path) -> ImportStatus | None:
    """The import MODEL_DIR holds, or None (none, or what is there does not parse)."""
    model_dir = Path(model_dir)
    for rel, complete in ((UNBUNDLE_STATE, False), (IMPORT_RECORD, True)):
        path = model_dir / rel
        if path.is_file() and not path.is_symlink():
            try:
                return _parse(read_json_file(path, what="import record"), str(path), complete)
            except (BadInput, OSError, ValueError):
                return None
    return None


def _parse(doc: object, where: str, complete: bool) -> ImportStatus:
    at = At(where)
    at.obj(doc)
    volumes = at.get_int(doc, "volumes", lo=1, hi=MAX_VOLUMES)
    done = tuple(at.key("done_volumes").index(i).int(n, 1, volumes)
                 for i, n in enumerate(at.get_list(doc, "done_volumes", [], max_len=volumes)))
    read_from = {int(k): at.key("read_from").key(k).str(v)
                 for k, v in at.get_obj(doc, "read_from", {}).items() if k.isdigit() and len(k) <= 7}
    files = tuple(at.key("volume_files").index(i).str(f, max_len=255)
                  for i, f in enumerate(at.get_list(doc, "volume_files", [], max_len=volumes)))
    return ImportStatus(at.get_str(doc, "name", max_len=255), volumes, done, read_from,
                        files if len(files) == volumes else (), complete)


def import_remedy(model_dir: Path, damaged: int = 0) -> str | None:
    """What to run when MODEL_DIR came from a bundle and is incomplete, or DAMAGED files (changed or missing since
    a complete import) need restoring: the volumes, never the Hub. None when no bundle's import is recorded."""
    status = import_status(model_dir)
    if status is None:
        return None
    d = shlex.quote(str(model_dir))
    if not status.complete and status.missing:
        named = [status.volume_files[n - 1] for n in status.missing[:3]] if status.volume_files else []
        came = "; ".join(status.places_read())
        return (f"volume(s) {', '.join(map(str, status.missing))} of {status.volumes} of bundle {status.name} not "
                f"imported yet" + (f" ({', '.join(named)})" if named else "") + f": mm unbundle <where it is> --dest {d}"
                + (f" (the others were read from {came})" if came else ""))
    if status.complete and damaged:
        where = " ".join(shlex.quote(p) for p in status.places_read()) or "<its volumes>"
        return (f"mm unbundle {where} --dest {d}   (imports again from bundle {status.name}'s volumes the "
                f"{damaged} file(s) changed or missing since the import, then verifies)")
    return None
