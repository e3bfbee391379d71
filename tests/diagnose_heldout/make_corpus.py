"""Writes tests/diagnose_heldout/: cases written from the messages' sources and log formats, before any detector
was tuned on them."""
import json, os
from pathlib import Path
D = Path(__file__).parent
E = "\x1b"
cases = {}
def ts(i): return f"2026-12-03T09:{10 + i // 60:02d}:{i % 60:02d}.{123456789 + i:09d}Z"
def sg(i, tp=None): return f"[2026-12-03 09:{10 + i // 60:02d}:{i % 60:02d}{' TP%d' % tp if tp is not None else ''}]"
def cri(lines, stream="stderr"): return [f"{ts(i)} {stream} F {l}" for i, l in enumerate(lines)]
def dts(lines): return [f"{ts(i)} {l}" for i, l in enumerate(lines)]
def jfile(lines): return [json.dumps({"log": l + "\n", "stream": "stderr", "time": ts(i)}) for i, l in enumerate(lines)]
def add(name, lines, expect, source, fmt, ext="log", **kw):
    fn = f"{name}.{ext}"
    (D / fn).write_text("\n".join(lines) + "\n")
    cases[name] = {"file": fn, "expect": expect, "source": source, "format": fmt, **kw}

START = [f"{sg(0)} server_args=ServerArgs(model_path='/models/MiniMax-M3.1-Flash', tokenizer_path='/models/MiniMax-M3.1-Flash', host='0.0.0.0', port=30000, tp_size=4, mem_fraction_static=0.92, chunked_prefill_size=16384, reasoning_parser='minimax-m3', tool_call_parser='minimax-m3')",
         f"{sg(2, 0)} Init torch distributed begin.", f"{sg(2, 1)} Init torch distributed begin.",
         f"{sg(2, 2)} Init torch distributed begin.", f"{sg(2, 3)} Init torch distributed begin.",
         f"{sg(9, 0)} Init torch distributed ends. mem usage=1.12 GB", f"{sg(10, 0)} Load weight begin. avail mem=266.41 GB"]
OOM_TB = [f"{sg(70, 2)} Scheduler hit an exception: Traceback (most recent call last):",
          '  File "/sgl-workspace/sglang/python/sglang/srt/managers/scheduler.py", line 2801, in run_scheduler_process',
          "    scheduler = Scheduler(server_args, port_args, gpu_id, tp_rank, moe_ep_rank, pp_rank, dp_rank)",
          "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.50 GiB. GPU 2 has a total capacity of 178.35 GiB of which 1.21 GiB is free. Including non-PyTorch memory, this process has 177.12 GiB memory in use. Of the allocated memory 170.02 GiB is allocated by PyTorch, and 4.88 GiB is reserved by PyTorch but unallocated."]
src_oom = "PyTorch c10/cuda/CUDACachingAllocator.cpp OutOfMemoryError text; SGLang 0.5.23 scheduler.py 'Scheduler hit an exception'; ServerArgs repr from srt/server_args.py"

# --- formats around a known failure -----------------------------------------------------------
add("f-cri-oom", cri(START + OOM_TB), "cuda-oom", src_oom, "Kubernetes CRI log (kubelet /var/log/pods): TS STREAM F|P LINE")
long_oom = OOM_TB[-1]
add("f-cri-partial-oom", cri(START) + [f"{ts(50)} stderr P {long_oom[:60]}", f"{ts(51)} stderr F {long_oom[60:]}"],
    "cuda-oom", src_oom, "CRI partial lines: kubelet splits a long line into P pieces ended by an F piece")
add("f-docker-ts-oom", dts(START + OOM_TB), "cuda-oom", src_oom, "docker logs --timestamps (RFC3339Nano prefix)")
add("f-jsonfile-oom", jfile(START + OOM_TB), "cuda-oom", src_oom, "docker json-file driver lines {log, stream, time}")
add("f-ansi-oom", START + [f"{E}[1;31mTraceback (most recent call last):{E}[0m",
                            f"{E}[1;35mtorch.OutOfMemoryError{E}[0m: {E}[35mCUDA out of memory. Tried to allocate 2.00 GiB.{E}[0m"],
    "cuda-oom", src_oom, "ANSI colours inside the message (a coloured traceback: rich / better-exceptions)")
add("f-structlog-oom", [json.dumps({"timestamp": ts(0), "level": "error", "logger": "sglang.srt.managers.scheduler",
                                    "message": "Scheduler hit an exception: Traceback (most recent call last):\n  File \"scheduler.py\", line 2801\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB."})],
    "cuda-oom", src_oom, "a JSON log line from a log shipper: the message field holds the multi-line traceback")
add("f-tp-interleaved-nccl", START[:5] + [
    f"{sg(600, 1)} [rank1]:[E1203 09:20:00.123456 ProcessGroupNCCL.cpp:632] [Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600015 milliseconds before timing out.",
    f"{sg(600, 0)} Load weight end. type=MiniMaxM3SparseForConditionalGeneration, dtype=torch.bfloat16, avail mem=199.87 GB, mem usage=66.54 GB.",
    f"{sg(600, 3)} [rank3]:[E1203 09:20:00.223456 ProcessGroupNCCL.cpp:1834] [PG ID 0 PG GUID 0(default_pg) Rank 3] Process group watchdog thread terminated with exception: [Rank 3] Watchdog caught collective operation timeout"],
    "nccl-hang", "PyTorch torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp watchdog messages with the [rankN]: prefix", "TP-rank interleaved lines")
add("f-ansi-uvicorn-503-after-ready", START + [f"{sg(130)} The server is fired up and ready to roll!"] +
    [f'{E}[32mINFO{E}[0m:     127.0.0.1:5{i:04d} - "GET /health HTTP/1.1" {E}[91m503 Service Unavailable{E}[0m' for i in range(4)],
    "health-failing", "uvicorn AccessFormatter with use_colors (levelprefix and status coloured); SGLang http_server.py ready line", "ANSI-coloured uvicorn access log")
add("f-jsonfile-503-after-ready", jfile(START + [f"{sg(130)} The server is fired up and ready to roll!",
    'INFO:     127.0.0.1:50420 - "GET /health HTTP/1.1" 503 Service Unavailable',
    'INFO:     127.0.0.1:50421 - "GET /health HTTP/1.1" 503 Service Unavailable']),
    "health-failing", "uvicorn access line; docker json-file escapes the quotes", "docker json-file driver lines")
add("f-cri-weights-missing", cri(START + [f"{sg(12, 0)} Loading safetensors checkpoint shards: 10% Completed | 6/59",
    "FileNotFoundError: [Errno 2] No such file or directory: '/models/MiniMax-M3.1-Flash/model-00007-of-00059.safetensors'"]),
    "weights-incomplete", "Python FileNotFoundError for a shard the index names", "CRI")
add("f-docker-ts-aot", dts([f"{sg(60, 0)} RuntimeError: JIT compilation is disabled and AOT kernel msa_v1_q8kv4_decode_sm100 was not found in /root/.cache/minfer/aot"]),
    "msa-jit-disabled", "MiniMax-AI/MSA inference/msa_v1/aot_cache.py try_load_aot", "docker logs --timestamps")
add("f-jsonfile-thinking-400", jfile([f'{sg(200)} ERROR:    Error in request: thinking.type must be \'adaptive\', \'enabled\' or \'disabled\'']),
    "thinking-type-400", "SGLang 0.5.23 serving_chat.py _validate", "docker json-file")
add("f-cri-dspark", cri([f"{sg(0)} ValueError: M3.1 NVFP4 DSPARK requires Blackwell (sm100 or newer); got sm90"]),
    "dspark-needs-blackwell", "SGLang 0.5.23 srt/arg_groups/model_overrides/minimax_m3.py", "CRI")
add("f-cri-enospc", cri(START + ["OSError: [Errno 28] No space left on device: '/root/.cache/flashinfer/100a/cached_ops/fused_moe'"]),
    "weights-incomplete", "Python OSError ENOSPC; guide row 6 cause 'full disk'", "CRI")

# --- sibling messages from the sources ---------------------------------------------------------
add("s-hf-revision-not-found", ["Traceback (most recent call last):",
    "huggingface_hub.errors.RevisionNotFoundError: 404 Client Error. (Request ID: Root=1-6752f1a3-1b2c3d4e5f)",
    "", "Revision Not Found for url: https://huggingface.co/api/models/MiniMaxAI/MiniMax-M3.1-Flash/revision/0f3c2a1.",
    "Invalid rev id: 0f3c2a1"], "weights-incomplete",
    "huggingface_hub utils/_http.py hf_raise_for_status: RevisionNotFound -> '{status} Client Error.\\n\\nRevision Not Found for url: {url}.'", "plain")
add("s-hf-entry-not-found", ["huggingface_hub.errors.EntryNotFoundError: 404 Client Error. (Request ID: Root=1-1)", "",
    "Entry Not Found for url: https://huggingface.co/MiniMaxAI/MiniMax-M3.1-Flash/resolve/0f3c2a1/model-00031-of-00059.safetensors."],
    "weights-incomplete", "huggingface_hub utils/_http.py hf_raise_for_status: EntryNotFound", "plain")
add("s-hf-offline-cannot-find", ["huggingface_hub.errors.LocalEntryNotFoundError: Cannot find the requested files in the disk cache and outgoing traffic has been disabled. To enable hf.co look-ups and downloads online, set 'local_files_only' to False."],
    "weights-incomplete", "huggingface_hub file_download.py _raise_on_head_call_error (HF_HUB_OFFLINE)", "plain")
add("s-vllm-weights-not-initialized", [f"(EngineCore_DP0 pid=312) ERROR 12-03 09:12:01 [core.py:708] ValueError: Following weights were not initialized from checkpoint: {{'model.layers.47.mlp.experts.w13_weight'}}"],
    "weights-incomplete", "vLLM model_executor/model_loader/default_loader.py load_weights", "vLLM engine core prefix", engine="vllm")
add("s-c10d-wait-timeout", [f"{sg(900, 1)} torch.distributed.DistStoreError: wait timeout after 600000ms, keys: /default_pg//cuda//0"],
    "nccl-hang", "PyTorch torch/csrc/distributed/c10d/TCPStore.cpp doWait ('wait timeout after {}ms, keys: {}')", "SGLang TP prefix")
add("s-c10d-client-socket-timeout", ["torch.distributed.DistNetworkError: The client socket has timed out after 600000ms while trying to connect to (10.0.0.5, 29500)."],
    "nccl-hang", "PyTorch torch/csrc/distributed/c10d/socket.cpp (DistNetworkError)", "plain")
add("s-c10d-socket-timeout", ["[rank2]: torch.distributed.DistStoreError: Socket Timeout"],
    "nccl-hang", "PyTorch c10d TCPStore client read timeout ('Socket Timeout')", "plain")
add("s-kubelet-readiness-http", ["Events:", "  Type     Reason     Age                 From               Message",
    "  ----     ------     ----                ----               -------",
    "  Normal   Scheduled  15m                 default-scheduler  Successfully assigned ml/minimax-0 to gpu-node-3",
    "  Normal   Started    15m                 kubelet            Started container sglang",
    "  Warning  Unhealthy  2m (x40 over 12m)   kubelet            Readiness probe failed: HTTP probe failed with statuscode: 503"],
    "health-failing", "kubelet pkg/probe/http/http.go ('HTTP probe failed with statuscode: %d'); pkg/kubelet/prober/prober.go ('%s probe failed: %s')", "kubectl describe pod events")
add("s-kubelet-readiness-refused", ["  Warning  Unhealthy  30s (x12 over 3m)  kubelet  Readiness probe failed: Get \"http://10.1.4.7:30000/health\": dial tcp 10.1.4.7:30000: connect: connection refused"],
    "health-failing", "kubelet prober.go; Go net/http client error text", "kubectl describe pod events")
add("s-kubelet-liveness-timeout", ["LAST SEEN   TYPE      REASON      OBJECT           MESSAGE",
    "45s         Warning   Unhealthy   pod/minimax-0    Liveness probe failed: Get \"http://10.1.4.7:30000/health\": context deadline exceeded (Client.Timeout exceeded while awaiting headers)",
    "40s         Normal    Killing     pod/minimax-0    Container sglang failed liveness probe, will be restarted"],
    "health-failing", "kubelet prober.go and kuberuntime 'failed liveness probe, will be restarted'", "kubectl get events")
add("s-docker-ps-unhealthy", ["CONTAINER ID   IMAGE                           COMMAND                  CREATED          STATUS                      PORTS                         NAMES",
    "3f2a9c1d7e44   lmsysorg/sglang:v0.5.23-cu134   \"python3 -m sglang.l…\"   20 minutes ago   Up 20 minutes (unhealthy)   127.0.0.1:30000->30000/tcp   mm-minimax"],
    "health-failing", "docker ps STATUS with a HEALTHCHECK ('(unhealthy)')", "docker ps")
add("s-docker-inspect-health", ['{"Status":"unhealthy","FailingStreak":7,"Log":[{"Start":"2026-12-03T09:30:00.1Z","End":"2026-12-03T09:30:05.1Z","ExitCode":1,"Output":"curl: (22) The requested URL returned error: 503\\n"}]}'],
    "health-failing", "docker inspect --format '{{json .State.Health}}'", "json")
add("s-docker-events-unhealthy", ["2026-12-03T09:31:00.000000000Z container health_status: unhealthy 3f2a9c1d7e44 (image=lmsysorg/sglang:v0.5.23-cu134, name=mm-minimax)"],
    "health-failing", "docker events health_status event", "docker events")
add("s-torch-oom-accelerator", [f"{sg(80, 0)} torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 139.81 GiB of which 3.06 MiB is free."],
    "cuda-oom", src_oom, "SGLang TP prefix")
add("s-cuda-graph-oom-hint", [f"{sg(90, 0)} Exception: Capture cuda graph failed: CUDA out of memory. Tried to allocate 512.00 MiB.",
    "Possible solutions:", "1. set --mem-fraction-static to a smaller value (e.g., 0.8 or 0.7)"],
    "cuda-oom", "SGLang 0.5.23 srt/model_executor/cuda_graph_runner.py 'Capture cuda graph failed: ' + hints", "SGLang TP prefix")
add("s-nccl-connect-refused", [f"{sg(5, 2)} NCCL WARN socketStartConnect: Connect to 10.0.0.6<45123> failed : Software caused connection abort",
    f"{sg(5, 2)} torch.distributed.DistBackendError: NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, remote process exited or there was a network error, NCCL version 2.27.3",
    "ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely."],
    "nccl-hang", "NCCL src/misc/socket.cc; PyTorch C10D_NCCL_CHECK", "SGLang TP prefix")
add("s-safetensors-incomplete", ["safetensors_rust.SafetensorError: Error while deserializing header: incomplete metadata, file not fully covered"],
    "weights-incomplete", "safetensors 0.8.0 lib", "plain")
add("s-aot-load-failed", [f"{sg(61, 0)} WARNING Failed to load AOT kernel from /root/.cache/minfer/aot/q8kv4_decode.so: /root/.cache/minfer/aot/q8kv4_decode.so: file too short"],
    "kernel-cache-not-persisted", "MSA inference/msa_v1/aot_cache.py try_load_aot", "SGLang TP prefix")
add("s-curl-connect-refused", ["$ curl -sf http://127.0.0.1:30000/health", "curl: (7) Failed to connect to 127.0.0.1 port 30000 after 0 ms: Couldn't connect to server"],
    "health-failing", "curl 8.x error text", "terminal", ext="txt")

# --- a later harmless line must not hide an earlier failure -------------------------------------
add("h-503-then-shutdown", START + [f"{sg(130)} The server is fired up and ready to roll!"] +
    ['INFO:     127.0.0.1:50421 - "GET /health HTTP/1.1" 503 Service Unavailable'] * 5 +
    [f"{sg(900)} Health check request received during shutdown. Returning 503.",
     'INFO:     127.0.0.1:50500 - "GET /health HTTP/1.1" 503 Service Unavailable'],
    "health-failing", "SGLang 0.5.23 http_server.py: 503 from /health after ready, then a shutdown", "plain")

# --- traps: look like failures, are not ---------------------------------------------------------
add("t-answer-quotes-think-tags", [json.dumps({"id": "c1", "object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant",
    "content": "MiniMax M3 writes its reasoning between <mm:think> and </mm:think>; the reasoning parser moves it to reasoning_content, so clients never see the tags."}, "finish_reason": "stop"}]})],
    None, "an answer about the model, quoting the tags (OpenAI chat.completion shape)", "json", ext="json")
add("t-c10d-ipv6-warning", START[:5] + ["[W1203 09:10:02.000000000 socket.cpp:755] [c10d] The client socket cannot be initialized to connect to [localhost]:29500 (errno: 97 - Address family not supported by protocol)."] +
    [f"{sg(130)} The server is fired up and ready to roll!"],
    None, "PyTorch c10d socket.cpp harmless IPv6 warning on hosts without IPv6", "plain")
add("t-nccl-info-debug", START[:5] + [f"{sg(3, 0)} gpu-node-3:312:312 [0] NCCL INFO NCCL_SOCKET_IFNAME set by environment to eth0",
    f"{sg(3, 0)} gpu-node-3:312:312 [0] NCCL INFO Channel 00/32 : 0 1 2 3", f"{sg(3, 0)} gpu-node-3:312:312 [0] NCCL INFO Connected all rings",
    f"{sg(130)} The server is fired up and ready to roll!"], None, "NCCL_DEBUG=INFO output of a healthy start", "plain")
add("t-kubelet-startup-probe-then-ready", ["  Warning  Unhealthy  9m (x20 over 12m)  kubelet  Startup probe failed: HTTP probe failed with statuscode: 503",
    "  Normal   Started    12m                kubelet  Started container sglang"],
    None, "kubelet: a startup probe answering 503 while the model loads is how startup probes work (failureThreshold)", "kubectl describe pod events")
add("t-hf-offline-warning", ["UserWarning: `local_files_only` is set; huggingface_hub is in offline mode (HF_HUB_OFFLINE=1)", f"{sg(130)} The server is fired up and ready to roll!"],
    None, "a harmless offline-mode note and a ready server", "plain")

# --- healthy inputs in each format ----------------------------------------------------------------
READY = START + [f"{sg(12, 0)} Loading safetensors checkpoint shards: 100% Completed | 59/59",
                 f"{sg(65, 0)} Load weight end. type=MiniMaxM3SparseForConditionalGeneration, dtype=torch.bfloat16, avail mem=199.87 GB, mem usage=66.54 GB.",
                 f"{sg(70, 0)} Compiled inference.dequant.nvfp4_to_fp8 backend=qmul4 in 38.4s",
                 f"{sg(120)} INFO:     Application startup complete.",
                 'INFO:     127.0.0.1:50300 - "GET /health HTTP/1.1" 503 Service Unavailable',
                 f"{sg(130)} The server is fired up and ready to roll!",
                 'INFO:     127.0.0.1:50420 - "GET /health HTTP/1.1" 200 OK']
src_ok = "SGLang 0.5.23 healthy start (srt/entrypoints/http_server.py, model_runner.py); uvicorn access lines"
add("ok-plain", READY, None, src_ok, "plain")
add("ok-cri", cri(READY), None, src_ok, "CRI")
add("ok-cri-stdout-partial", cri(READY[:3], "stdout") + [f"{ts(9)} stdout P {READY[3][:30]}", f"{ts(10)} stdout F {READY[3][30:]}"] + cri(READY[3:]),
    None, src_ok, "CRI partial")
add("ok-docker-ts", dts(READY), None, src_ok, "docker logs --timestamps")
add("ok-jsonfile", jfile(READY), None, src_ok, "docker json-file")
add("ok-ansi", [f"{E}[32m{l}{E}[0m" for l in READY], None, src_ok, "ANSI")
add("ok-kubelet-normal", ["  Normal  Scheduled  15m  default-scheduler  Successfully assigned ml/minimax-0 to gpu-node-3",
    "  Normal  Pulled     15m  kubelet  Container image \"lmsysorg/sglang:v0.5.23-cu134\" already present on machine",
    "  Normal  Created    15m  kubelet  Created container sglang", "  Normal  Started    15m  kubelet  Started container sglang"],
    None, "kubelet normal events", "kubectl describe pod events")
add("ok-docker-ps-healthy", ["CONTAINER ID   IMAGE                           COMMAND                  CREATED          STATUS                    PORTS                         NAMES",
    "3f2a9c1d7e44   lmsysorg/sglang:v0.5.23-cu134   \"python3 -m sglang.l…\"   20 minutes ago   Up 20 minutes (healthy)   127.0.0.1:30000->30000/tcp   mm-minimax"],
    None, "docker ps with a passing HEALTHCHECK", "docker ps")
add("ok-structlog", [json.dumps({"timestamp": ts(i), "level": "info", "message": l}) for i, l in enumerate(READY)], None, src_ok, "JSON log lines")
add("ok-vllm-ts", dts(["(APIServer pid=1) INFO 12-03 09:10:00 [api_server.py:1805] vLLM server version 0.33.0, serving model /models/MiniMax-M3.1-Flash",
    "(APIServer pid=1) INFO 12-03 09:10:00 [utils.py:326] non-default args: {'model': '/models/MiniMax-M3.1-Flash', 'tensor_parallel_size': 4, 'reasoning_parser': 'minimax_m3', 'tool_call_parser': 'minimax_m3', 'enable_auto_tool_choice': True}",
    "(APIServer pid=1) INFO:     Application startup complete.", '(APIServer pid=1) INFO:     127.0.0.1:40000 - "GET /health HTTP/1.1" 200 OK']),
    None, "vLLM 0.33.0 startup lines", "docker logs --timestamps", engine="vllm")
add("ok-answer-text", [json.dumps({"object": "chat.completion", "choices": [{"message": {"role": "assistant", "content": "Paris.", "reasoning_content": "The capital of France is Paris."}}]})],
    None, "OpenAI chat.completion shape with reasoning_content", "json", ext="json")

(D / "index.json").write_text(json.dumps({"about": "written from the messages' sources and log formats before the detectors were tuned; never tune a detector on these", "cases": cases}, indent=1) + "\n")
print(len(cases), sum(1 for c in cases.values() if c["expect"]), "failures")
