"""Make a small model repo shaped like MiniMax-M3.1-Flash, with real safetensors files.

Dense layers are MXFP8-like (F8_E4M3 weights with U8 E8M0 block scales), routed experts are
NVFP4-like (U8 packed 2 values/byte with F8_E4M3 block scales and an F32 global scale), embeddings
BF16, and a DSpark draft under dspark/ with its own config, index and shard. Content is seeded
random bytes, so two calls with the same arguments write identical files.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors import TensorSpec, serialize_file

HIDDEN = 64


def _tensor_plan(layer: int, expert_bytes: int) -> list[tuple[str, str, list[int]]]:
    """(name, safetensors dtype, shape) for one decoder layer; experts sized to fill the shard."""
    experts = 8
    per_row = HIDDEN // 2 + HIDDEN // 16  # packed FP4 bytes + FP8 block scales per output row
    rows = max(16, expert_bytes // (experts * 3 * per_row) // 16 * 16)
    p = f"model.layers.{layer}"
    plan = [
        (f"{p}.input_layernorm.weight", "bfloat16", [HIDDEN]),
        (f"{p}.self_attn.q_proj.weight", "float8_e4m3fn", [HIDDEN, HIDDEN]),
        (f"{p}.self_attn.q_proj.weight_scale_inv", "uint8", [HIDDEN, HIDDEN // 32]),
        (f"{p}.self_attn.o_proj.weight", "float8_e4m3fn", [HIDDEN, HIDDEN]),
        (f"{p}.self_attn.o_proj.weight_scale_inv", "uint8", [HIDDEN, HIDDEN // 32]),
        (f"{p}.mlp.gate.weight", "bfloat16", [experts, HIDDEN]),
    ]
    for e in range(experts):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            q = f"{p}.mlp.experts.{e}.{proj}"
            plan += [
                (f"{q}.weight", "uint8", [rows, HIDDEN // 2]),  # NVFP4: two values a byte
                (f"{q}.weight_scale", "float8_e4m3fn", [rows, HIDDEN // 16]),
                (f"{q}.weight_scale_2", "float32", [1]),
            ]
    return plan


_ITEMSIZE = {"bfloat16": 2, "float8_e4m3fn": 1, "uint8": 1, "float32": 4}


def _write_shard(path: Path, plan: list[tuple[str, str, list[int]]], rng: np.random.Generator) -> list[str]:
    buffers = []
    specs = {}
    for name, dtype, shape in plan:
        n = _ITEMSIZE[dtype] * int(np.prod(shape))
        buf = np.frombuffer(rng.bytes(n), dtype=np.uint8).copy()
        buffers.append(buf)
        specs[name] = TensorSpec(dtype=dtype, shape=shape, data_ptr=buf.ctypes.data, data_len=n)
    path.parent.mkdir(parents=True, exist_ok=True)
    serialize_file(specs, str(path), metadata={"format": "pt"})
    path.chmod(0o644)
    return [name for name, _, _ in plan]


def _write_checkpoint(root: Path, shards: int, shard_bytes: int, layers_per_shard: int, rng, extra_first: bool) -> dict:
    weight_map: dict[str, str] = {}
    total = 0
    layer = 0
    for s in range(1, shards + 1):
        fname = f"model-{s:05d}-of-{shards:05d}.safetensors"
        plan = []
        if extra_first and s == 1:
            plan.append(("model.embed_tokens.weight", "bfloat16", [256, HIDDEN]))
        for _ in range(layers_per_shard):
            plan += _tensor_plan(layer, shard_bytes // layers_per_shard)
            layer += 1
        if extra_first and s == shards:
            plan.append(("lm_head.weight", "bfloat16", [256, HIDDEN]))
        for name in _write_shard(root / fname, plan, rng):
            weight_map[name] = fname
        total += (root / fname).stat().st_size
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return {"layers": layer}


def write_model(root: Path, *, shards: int = 4, shard_bytes: int = 256 * 1024, draft: bool = True,
                seed: int = 0, config_extra: dict | None = None) -> list[str]:
    """Write the repo's files under ROOT and return their relative POSIX paths, sorted."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    info = _write_checkpoint(root, shards, shard_bytes, 2, rng, extra_first=True)
    config = {
        "architectures": ["MiniMaxM3ForCausalLM"],
        "model_type": "minimax_m3",
        "hidden_size": HIDDEN,
        "num_hidden_layers": info["layers"],
        "quantization_config": {"quant_method": "modelopt", "dense": "mxfp8", "experts": "nvfp4"},
        "speculative_config": {"algorithm": "DSPARK", "draft_subfolder": "dspark"} if draft else None,
        "torch_dtype": "bfloat16",
    }
    config.update(config_extra or {})
    _write_json(root / "config.json", config)
    _write_json(root / "generation_config.json", {"temperature": 1.0, "top_p": 0.95})
    _write_json(root / "tokenizer_config.json", {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1048576})
    _write_json(root / "tokenizer.json", {"version": "1.0", "model": {"type": "BPE", "vocab": {f"t{i}": i for i in range(256)}, "merges": []}})
    (root / "README.md").write_text("# MiniMax-M3.1-Flash (test double)\n\nSmall generated model shaped like the real checkpoint.\n")
    (root / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
    if draft:
        d = root / "dspark"
        _write_checkpoint(d, 1, max(shard_bytes // 4, 16 * 1024), 1, rng, extra_first=False)
        _write_json(d / "config.json", {"architectures": ["DSparkDraftModel"], "model_type": "dspark", "hidden_size": HIDDEN})
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def write_fetched_model(root: Path, revision: str, repo_id: str = "MiniMaxAI/MiniMax-M3.1-Flash", **kwargs) -> Path:
    """write_model (KWARGS) plus the manifest `mm fetch` would have left (adopted offline at REVISION); ROOT."""
    from mm.artifacts.fetching.adopt import manifest_for_local_dir

    write_model(root, **kwargs)
    manifest_for_local_dir(root, repo_id, revision, offline=True)
    return Path(root)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")
