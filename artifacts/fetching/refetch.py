"""Repair a model directory: re-fetch only what verify found missing or corrupt, then verify again.

Every byte is hashed once: the re-verify hashes only the files the source rewrote (the others were hashed by
the first verify and left untouched), and on a healthy directory there is no re-verify at all.

Good files are never touched: a source writes the damaged files under temporary names and renames
each over its final name only after it matches the upstream identity. The Hub is the only source
today; a bundle can become a second one by implementing RepairSource.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ..errors import RemoteError
from ..integrity.manifest import Manifest, read_manifest
from ..paths import manifest_path
from ..edges.progress import NULL_PROGRESS, ProgressSink
from ..integrity.verify import REPAIRABLE, Problem, VerifyReport, verify_dir


class RepairSource(Protocol):
    label: str  # shown in the report, e.g. "hub"

    def restore(self, model_dir: Path, manifest: Manifest, paths: frozenset[str], progress: ProgressSink) -> None:
        """Replace exactly PATHS under MODEL_DIR with bytes matching MANIFEST, atomically, updating its entries.

        Raises an MMError (RemoteError, IntegrityError, ...) when a file cannot be restored.
        """


@dataclass(frozen=True)
class HubRepairSource:
    """Fetch the damaged files from the Hub at the manifest's commit (resumable, verified, atomic)."""

    endpoint: str | None = None
    token: str | None = field(default=None, repr=False)
    workers: int = 4
    label: str = "hub"

    def restore(self, model_dir: Path, manifest: Manifest, paths: frozenset[str], progress: ProgressSink) -> None:
        from .fetch import FetchRequest, fetch  # the Hub client loads only when a repair needs it

        req = FetchRequest(repo_id=manifest.repo_id, revision=manifest.revision, local_dir=Path(model_dir),
                           endpoint=self.endpoint, token=self.token, workers=self.workers, repo_type=manifest.repo_type)
        result = fetch(req, progress, refetch=paths)
        if result.failed:
            first = result.failed[0]  # the failure's own class: the CLI gives it its exit code
            raise first.error_kind(f"{model_dir}: could not restore {len(result.failed)} file(s) from the Hub; "
                                   f"{first.path}: {first.error}")


@dataclass(frozen=True)
class RefetchReport:
    model_dir: str
    source: str
    before: VerifyReport
    restored: tuple[str, ...]  # paths handed to the source
    after: VerifyReport

    @property
    def ok(self) -> bool:
        return self.after.ok

    @property
    def remaining(self) -> tuple[Problem, ...]:
        return self.after.problems

    @property
    def unrepairable(self) -> tuple[Problem, ...]:
        """Problems no download fixes (extra files, symlinks, structure of bytes that match the manifest)."""
        return tuple(p for p in self.after.problems if p.kind not in REPAIRABLE)


def repair_dir(model_dir: Path, *, source: RepairSource | None = None, jobs: int | None = None,
               progress: ProgressSink = NULL_PROGRESS) -> RefetchReport:
    """Verify MODEL_DIR against its manifest, restore the damaged files from SOURCE (the Hub), verify again."""
    model_dir = Path(model_dir)
    manifest = read_manifest(manifest_path(model_dir))
    source = source or HubRepairSource()
    before = verify_dir(model_dir, manifest, jobs=jobs, progress=progress)
    # files the revision lists that were never proven here are fetched too, even when bytes sit at their path
    damaged = before.repairable() | {f.path for f in manifest.unproven}
    if damaged:
        try:
            source.restore(model_dir, manifest, damaged, progress)
        except RemoteError as e:  # an air-gapped host: the volumes it was imported from restore it, not the Hub
            from ..integrity.provenance import import_remedy
            if remedy := import_remedy(model_dir, damaged=len(damaged)):
                raise type(e)(f"{e.message}; {model_dir} came from a bundle, whose volumes restore it: {remedy}") \
                    from None
            raise
        # the source rewrote the manifest's entries; only its files are hashed again
        after = verify_dir(model_dir, jobs=jobs, progress=progress, rehash=damaged)
    else:
        after = before
    return RefetchReport(model_dir=str(model_dir), source=source.label, before=before,
                        restored=tuple(sorted(damaged)), after=after)
