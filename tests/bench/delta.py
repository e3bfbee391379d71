"""Delta bundles against full ones: revision A is a 4 GiB model (4 x 1 GiB shards); revision B renames
one shard, changes the chat template and adds a 10 MB file. Interleaved in each round, on the same disks:

  mm bundle B (full)              against  mm bundle B --base A (delta): bytes carried, seconds
  mm unbundle full -> XFS         against  mm unbundle delta --from A -> XFS (reflinks)
  mm unbundle full -> plain dir   against  mm unbundle delta --from A -> plain dir (copies), and with --link

and the space each result takes on the destination beyond A (FIEMAP extents, each shared byte counted once: other
processes writing to the same disk do not disturb it). The XFS file system is a sparse image on a loop device
(`mkfs.xfs -m reflink=1`, root only); the plain dir is bench-work/ on this host's disk (ext4 here: no reflinks).
MM_BENCH_ROUNDS (default 2), MM_BENCH_DELTA_SHARD_BYTES (default 1 GiB) size it; MM_BENCH_KEEP=1 keeps bench-work/.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
from pathlib import Path

from tests.bench.common import make_bench_model, peer_bin, run_timed

WORK = Path(__file__).resolve().parents[2] / "bench-work" / "delta"
MM = Path(peer_bin("mm"))
SHARDS = 4
SHARD_BYTES = int(os.environ.get("MM_BENCH_DELTA_SHARD_BYTES", str(1024**3)))
CHANGED_BYTES = 10 * 10**6
ROUNDS = int(os.environ.get("MM_BENCH_ROUNDS", "2"))
VOLUME_SIZE = "2G"
REV_B = "b" * 40


def make_revision_b(a: Path, b: Path) -> int:
    """B: A's files (hard links, connected side) with the last shard renamed (its index follows), a new chat
    template, and a new 10 MB file. Returns the bytes B does not share with A."""
    import numpy as np
    from safetensors.numpy import save_file

    from mm.artifacts.fetching.adopt import manifest_for_local_dir

    if (b / ".mm" / "manifest.json").is_file():
        return CHANGED_BYTES
    shutil.rmtree(b, ignore_errors=True)
    shutil.copytree(a, b, copy_function=os.link, ignore=shutil.ignore_patterns(".mm"))
    last = f"model-{SHARDS:05d}-of-{SHARDS:05d}.safetensors"
    (b / last).rename(b / f"renamed-{last}")
    index_path = b / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"] = {k: f"renamed-{last}" if v == last else v for k, v in index["weight_map"].items()}
    index_path.unlink()
    index_path.write_text(json.dumps(index, indent=2) + "\n")
    (b / "tokenizer_config.json").unlink()
    (b / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}\n')
    rng = np.random.default_rng(22)
    save_file({"mtp.weight": rng.integers(0, 256, size=CHANGED_BYTES, dtype=np.uint8)}, str(b / "mtp.safetensors"))
    manifest_for_local_dir(b, "MiniMaxAI/MiniMax-M3.1-Flash", REV_B, offline=True)
    return CHANGED_BYTES


def tar_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.glob("*.tar"))


def new_space(base: Path, result: Path) -> int:
    """Bytes on disk RESULT's model files take beyond BASE's (shared extents and inodes counted once)."""
    from mm.artifacts.edges.sharing import DiskUse, layout

    def layouts(d: Path):
        return [layout(p) for p in d.rglob("*") if p.is_file() and not p.is_symlink() and ".mm" not in p.parts]
    mine = layouts(base)
    return DiskUse(mine + layouts(result)).bytes - DiskUse(mine).bytes


def timed(cmd: list[str]) -> float:
    seconds, _ = run_timed(cmd, WORK / "time.txt")
    return seconds


def xfs(size: int):
    image, mnt = WORK / "xfs.img", WORK / "xfs"
    mnt.mkdir(parents=True, exist_ok=True)
    subprocess.run(["umount", str(mnt)], capture_output=True)
    with open(image, "wb") as f:
        f.truncate(size)
    subprocess.run(["mkfs.xfs", "-q", "-f", "-m", "reflink=1", str(image)], check=True)
    subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], check=True)
    return image, mnt


def main() -> None:
    if os.geteuid() != 0 or shutil.which("mkfs.xfs") is None:
        print("bench delta: skipped (needs root and mkfs.xfs for the XFS loop image)")
        return
    WORK.mkdir(parents=True, exist_ok=True)
    a, b = WORK / "A", WORK / "B"
    print(f"bench delta: writing revision A ({SHARDS} x {SHARD_BYTES / 2**30:.2f} GiB) and B into {WORK} ...", flush=True)
    total = make_bench_model(a, SHARDS, SHARD_BYTES)
    changed = make_revision_b(a, b)
    full_a, full_b, delta_b = WORK / "full-A", WORK / "full-B", WORK / "delta-B"
    for d in (full_a, full_b, delta_b):
        shutil.rmtree(d, ignore_errors=True)
    subprocess.run([str(MM), "bundle", str(a), "--out", str(full_a), "--volume-size", VOLUME_SIZE, "--no-mm",
                    "--no-sync", "--json"], check=True, stdout=subprocess.DEVNULL)
    image, mnt = xfs(3 * total + 2 * 2**30)
    plain = WORK / "plain"
    rows: dict[str, list[float]] = {k: [] for k in ("bundle-full", "bundle-delta", "xfs-full", "xfs-delta",
                                                     "plain-full", "plain-delta", "plain-link")}
    space: dict[str, int] = {}
    try:
        shutil.rmtree(plain, ignore_errors=True)
        for fs in (mnt, plain):  # A imported on each destination once, from full volumes
            subprocess.run([str(MM), "unbundle", str(full_a), "--dest", str(fs / "A"), "--no-sync"], check=True,
                           stdout=subprocess.DEVNULL)
        shutil.rmtree(full_a)  # disk space: the benchmark holds A, B and their copies several times over
        subprocess.run(["sync"], check=True)
        for rnd in range(ROUNDS):
            for d in (full_b, delta_b, *(fs / n for fs in (mnt, plain) for n in ("B-full", "B-delta", "B-link"))):
                shutil.rmtree(d, ignore_errors=True)
            subprocess.run(["sync"], check=True)
            rows["bundle-full"].append(timed([str(MM), "bundle", str(b), "--out", str(full_b), "--volume-size",
                                              VOLUME_SIZE, "--no-mm"]))
            rows["bundle-delta"].append(timed([str(MM), "bundle", str(b), "--base", str(a), "--out", str(delta_b),
                                               "--volume-size", VOLUME_SIZE, "--no-mm"]))
            for label, fs in (("xfs", mnt), ("plain", plain)):
                rows[f"{label}-full"].append(timed([str(MM), "unbundle", str(full_b), "--dest", str(fs / "B-full")]))
                space[f"{label}-full"] = new_space(fs / "A", fs / "B-full")
                shutil.rmtree(fs / "B-full")
                rows[f"{label}-delta"].append(timed([str(MM), "unbundle", str(delta_b), "--dest", str(fs / "B-delta"),
                                                     "--from", str(fs / "A")]))
                space[f"{label}-delta"] = new_space(fs / "A", fs / "B-delta")
            rows["plain-link"].append(timed([str(MM), "unbundle", str(delta_b), "--dest", str(plain / "B-link"),
                                             "--from", str(plain / "A"), "--link"]))
            space["plain-link"] = new_space(plain / "A", plain / "B-link")
            print(f"  round {rnd + 1}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in rows.items()), flush=True)
        carried_full, carried_delta = tar_bytes(full_b), tar_bytes(delta_b)
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)
        image.unlink(missing_ok=True)

    def med(k: str) -> float:
        return statistics.median(rows[k])

    def ratio(mine: str, peer: str) -> float:  # median of the per-round ratios: each pair ran side by side
        return statistics.median(m / p for m, p in zip(rows[mine], rows[peer]))

    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"bench delta: A {total / 2**30:.2f} GiB in {SHARDS} shards; B renames a shard, changes the chat template and "
          f"adds {changed / 1e6:.0f} MB; {ROUNDS} interleaved rounds; load average {load}")
    print(f"  bytes carried    full {carried_full / 1e9:.3f} GB   delta {carried_delta / 1e6:.2f} MB   "
          f"delta/full {carried_delta / carried_full:.4f}")
    print(f"  bundle           full {med('bundle-full'):.2f} s   delta {med('bundle-delta'):.2f} s   "
          f"delta/full {ratio('bundle-delta', 'bundle-full'):.3f}")
    for label, what in (("xfs", "XFS, reflinks"), ("plain", "plain dir, copies")):
        print(f"  unbundle {what:<17} full {med(f'{label}-full'):.2f} s   delta {med(f'{label}-delta'):.2f} s   "
              f"delta/full {ratio(f'{label}-delta', f'{label}-full'):.3f}   new space on disk: full "
              f"{space[f'{label}-full'] / 1e9:.3f} GB, delta {space[f'{label}-delta'] / 1e6:.2f} MB")
    print(f"  unbundle plain dir, --link     {med('plain-link'):.2f} s   delta/full "
          f"{ratio('plain-link', 'plain-full'):.3f}   new space on disk: {space['plain-link'] / 1e6:.2f} MB")
    print("  (every unbundle ends with a full verify of the new directory; a delta also hashes each file it took)")
    if not os.environ.get("MM_BENCH_KEEP"):
        shutil.rmtree(WORK, ignore_errors=True)


if __name__ == "__main__":
    main()
