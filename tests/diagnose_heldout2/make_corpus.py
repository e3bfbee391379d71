"""Writes tests/diagnose_heldout2/: a second held-out round, written after the detectors were changed for the
first one and run once without any change after it (its figure is reported as it came)."""
import json
from pathlib import Path
D = Path(__file__).parent
E = "\x1b"
OOM = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity of 178.35 GiB of which 200.00 MiB is free."
READY = "[2026-12-03 09:12:10] The server is fired up and ready to roll!"
H503 = 'INFO:     127.0.0.1:50421 - "GET /health HTTP/1.1" 503 Service Unavailable'
cases = {}
def add(name, lines, expect, source, fmt):
    (D / f"{name}.log").write_text("\n".join(lines) + "\n")
    cases[name] = {"file": f"{name}.log", "expect": expect, "source": source, "format": fmt}

add("journald-oom", [f"Dec 03 09:12:01 gpu-node-3 3f2a9c1d7e44[812]: [2026-12-03 09:12:01 TP0] {OOM}"], "cuda-oom",
    "PyTorch CUDACachingAllocator.cpp", "journalctl of docker's journald log driver")
add("logfmt-oom", [f'time=2026-12-03T09:12:01Z level=error msg="{OOM}"'], "cuda-oom", "PyTorch", "logfmt")
add("logfmt-503-after-ready", [f'time=2026-12-03T09:12:10Z level=info msg="{READY}"',
    'time=2026-12-03T09:12:20Z level=info msg="INFO:     127.0.0.1:50421 - \\"GET /health HTTP/1.1\\" 503 Service Unavailable"'],
    "health-failing", "uvicorn access line inside logfmt (quotes escaped)", "logfmt")
add("podman-ts-nccl", ["2026-12-03T09:12:01.123456789+00:00 [rank0]:[E1203 09:12:01.1 ProcessGroupNCCL.cpp:632] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, OpType=ALLREDUCE) ran for 600015 milliseconds before timing out."],
    "nccl-hang", "PyTorch ProcessGroupNCCL.cpp", "podman logs --timestamps (numeric offset)")
add("kubectl-prefix-oom", [f"[pod/minimax-0/sglang] [2026-12-03 09:12:01 TP1] {OOM}"], "cuda-oom", "PyTorch", "kubectl logs --prefix")
add("compose-prefix-oom", [f"sglang-1  | [2026-12-03 09:12:01 TP0] {OOM}"], "cuda-oom", "PyTorch", "docker compose logs")
add("cri-ansi-nccl", [f"2026-12-03T09:12:01.1Z stderr F {E}[31m[rank3]:[E1203 ProcessGroupNCCL.cpp:632] [Rank 3] Watchdog caught collective operation timeout{E}[0m"],
    "nccl-hang", "PyTorch ProcessGroupNCCL.cpp", "CRI + ANSI")
add("transformers-offline-not-cached", ["OSError: We couldn't connect to 'https://huggingface.co' to load this file, couldn't find it in the cached files and it looks like MiniMaxAI/MiniMax-M3.1-Flash is not the path to a directory containing a file named config.json."],
    "weights-incomplete", "transformers utils/hub.py cached_files (offline, not cached)", "plain")
add("hub-local-entry-not-found", ["huggingface_hub.errors.LocalEntryNotFoundError: An error happened while trying to locate the file on the Hub and we cannot find the requested files in the local cache. Please check your connection and try again or make sure your Internet connection is on."],
    "weights-incomplete", "huggingface_hub file_download.py", "plain")
add("c10d-unique-id-store-timeout", ["[rank2]: torch.distributed.DistBackendError: [2] is setting up NCCL communicator and retrieving ncclUniqueId from [0] via c10d key-value store by key '0', but store->get('0') got error: wait timeout after 600000ms, keys: /default_pg//cuda//0"],
    "nccl-hang", "PyTorch ProcessGroupNCCL.cpp broadcastUniqueNCCLID", "torch rank prefix")
add("safetensors-metadata-incomplete", ["safetensors_rust.SafetensorError: Error while deserializing header: MetadataIncompleteBuffer"],
    "weights-incomplete", "safetensors", "plain")
add("trap-illegal-memory-access", ["RuntimeError: CUDA error: an illegal memory access was encountered", "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be incorrect."],
    None, "PyTorch c10_cuda_check_implementation: not a row of the guide's table", "plain")
add("trap-vllm-concurrency", ["(EngineCore_DP0 pid=312) INFO 12-03 09:12:01 [kv_cache_utils.py:1087] Maximum concurrency for 131,072 tokens per request: 12.30x",
    "(APIServer pid=1) INFO:     Application startup complete."], None, "vLLM healthy start", "vLLM")
add("ok-journald-start", [f"Dec 03 09:12:{i:02d} gpu-node-3 3f2a9c1d7e44[812]: {l}" for i, l in enumerate([
    "[2026-12-03 09:12:00 TP0] Load weight begin. avail mem=266.41 GB", "[2026-12-03 09:12:05 TP0] Compiled inference.dequant.nvfp4_to_fp8 backend=qmul4 in 38.4s",
    H503, READY, 'INFO:     127.0.0.1:50420 - "GET /health HTTP/1.1" 200 OK'])], None, "SGLang healthy start", "journald")
(D / "index.json").write_text(json.dumps({"about": "second held-out round: written after the first round's changes, run once, not tuned on", "cases": cases}, indent=1) + "\n")
