"""Engine wiring shared by every worker role: one frozen config → one vLLM `AsyncLLM`.

The prefill, decode and colocated workers differ only in `kv_role` (and the connector settings
that come with it); everything else about how vLLM is started lives here once. Defaults are sized
so that three tiny-model engines fit on a 2-core, 24 GiB laptop: the KV cache is an explicit
number of MiB rather than a fraction of host RAM, because on CPU vLLM's `gpu_memory_utilization`
means "fraction of host RAM to reserve" and three engines at the usual 0.9 cannot coexist.
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from splitserve import compilation
from splitserve.compilation import GRAPH_MODES
from splitserve.engine_core import ENGINE_CORE_NICE, lower_engine_core
from splitserve.engine_spin import SPIN_ENV, SPIN_S
from splitserve.kv.settings import KV_SECRET_ENV, ConnectorSettings
from splitserve.lifeline import ENGINE_PARENT_ENV
from splitserve.models import stored_dtype
from splitserve.settings import setting

if TYPE_CHECKING:  # vllm is heavy; import it only when an engine is really built
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from splitserve.engine_stats import EngineMonitor

log = logging.getLogger(__name__)

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass(frozen=True)
class EngineConfig:
    model: str = setting(
        None, "HF model directory, 'smollm2' (the default: SmolLM2-135M-Instruct, see "
        "fetch-model) or 'tiny'/'bench' (generated, random weights)")
    # "auto" is what this host runs fastest (`concrete_dtype`); golden tests use float32, where
    # exact token equality is expected.
    dtype: str = setting(
        "auto", "model dtype: auto (float32 for a checkpoint stored in float32, else what this "
        "host runs fastest: bfloat16 on GPUs and on CPUs with AVX512-BF16/AMX, float32 "
        "elsewhere), bfloat16, float16, float32")
    max_model_len: int = setting(4096, "prompt + output tokens of one request, at most")
    # vLLM's CPU attention needs a multiple of 32; 128 is its default there.
    block_size: int = setting(128, "tokens per KV cache block (a multiple of 32)")
    # An explicit size, not a fraction of memory: on CPU vLLM's fraction is of host RAM, and
    # three engines at the usual 0.9 cannot share a laptop.
    kv_cache_mib: int = setting(256, "KV cache size of this engine")
    kv_cache_dtype: str = setting(
        "auto", "KV cache dtype: auto (the model's) or fp8, which halves the cache's bytes "
        "against bf16 (and what a KV transfer moves); lossy. Prefill and decode pools must "
        "agree (the KV handshake refuses a mismatch)",
        choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"))
    memory_fraction: float = setting(
        0.1, "vLLM's gpu_memory_utilization (on CPU: the fraction of host RAM it may reserve)")
    max_num_seqs: int = setting(64, "sequences one engine step runs at most")
    max_num_batched_tokens: int | None = setting(
        None, "tokens per engine step (vLLM's chunked-prefill chunk; default: vLLM's, 2048 on "
        "CPU)")
    enable_prefix_caching: bool = setting(True, "reuse cached KV blocks of shared prefixes")
    speculative_tokens: int = setting(
        0, "n-gram speculative decoding (prompt lookup, no draft model): tokens proposed per "
        "step; 0 = off. For decode and colocated workers; greedy output is unchanged")
    # Compiled is vLLM's default and what its users compare against (splitserve/compilation.py).
    enforce_eager: bool = setting(
        False, "run the model eagerly: no torch.compile and no CUDA graphs (starts faster, "
        "runs slower)")
    cudagraph_mode: str = setting(
        "auto", "GPU only: vLLM's CUDA graph mode; auto is vLLM's default, except piecewise for "
        "prefill engines and layered KV loads (splitserve/compilation.py)", choices=GRAPH_MODES)
    compile_cache_dir: str | None = setting(
        None, "where compiled models are cached, shared by the engines of a host (default: "
        "vLLM's, ~/.cache/vllm)", metavar="DIR")
    seed: int = setting(0, "the engine's sampling seed")
    # Several engines on one host must not share cores: vLLM's "auto" binds each of them to the
    # same first core, and their spinning OpenMP threads then starve each other.
    cpu_cores: str = setting(
        "auto", "CPU only: cores for this engine's compute threads, e.g. 0 or 2-3 (auto: "
        "vLLM's choice)")
    # CPU: the EngineCore's spin must not starve the servers (splitserve/engine_core.py).
    engine_core_nice: int = setting(
        ENGINE_CORE_NICE, "CPU only: the niceness of the engine's scheduler process, which "
        "spins while its model runner computes (0: as vLLM starts it)")
    # CPU: vLLM's readers spin a second after each message; beside other work that starves
    # every program on a small host (splitserve/engine_spin.py).
    spin_s: float = setting(
        SPIN_S, "CPU only: how long the engine's processes spin waiting for each other before "
        "they sleep until notified (vLLM's own: 1)")
    # KV transfer: None = plain engine (colocated); else one of KV_ROLES with our connector.
    kv_role: str | None = setting(None, internal=True)
    kv_settings: ConnectorSettings = setting(factory=ConnectorSettings, internal=True)
    engine_id: str | None = setting(None, internal=True)  # its name in KV handshakes
    # A failed pull: "recompute" prefills locally (the request still succeeds, slower), "fail"
    # ends it with finish reason "error".
    kv_failure_policy: str = setting(
        "recompute", "what a decode engine does when a KV pull fails: recompute the prompt "
        "locally, or fail the request", choices=("recompute", "fail"))

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model: a model directory is required (models.resolve_model)")
        if self.kv_role is not None and self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {KV_ROLES}, got {self.kv_role!r}")
        if self.block_size % 32:
            raise ValueError(f"block_size must be a multiple of 32, got {self.block_size}")
        if self.kv_failure_policy not in ("recompute", "fail"):
            raise ValueError(f"kv_failure_policy must be recompute or fail, "
                             f"got {self.kv_failure_policy!r}")
        if self.speculative_tokens < 0:
            raise ValueError(f"speculative_tokens must be >= 0, got {self.speculative_tokens}")
        if not self.spin_s >= 0:
            raise ValueError(f"spin_s must be >= 0, got {self.spin_s}")
        if self.kv_cache_mib <= 0:
            raise ValueError(f"kv_cache_mib must be positive, got {self.kv_cache_mib}")
        compilation.check(self.enforce_eager, self.cudagraph_mode, self.layered_load)

    @property
    def layered_load(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both") and self.kv_settings.load == "layered"


def concrete_dtype(dtype: str, cpuinfo: str | None = None,
                   model_dir: str | None = None) -> tuple[str, str]:
    """`dtype` made concrete for this host, with the reason to print at start-up.

    "auto" for a checkpoint stored in float32 (its config.json says so) is float32: such a
    checkpoint asks for full precision, and the default model is one (SmolLM2 dequantized from
    4 bits, exact only in float32): run in bf16 by vLLM on CPU, it answered "What is the capital
    of France?" with "L'Étoile, la Marseillaise, la femme, ...", in float32 with transformers'
    exact answer. Otherwise "auto" on a GPU host is vLLM's own auto (the model's dtype). On CPU
    it is bfloat16 only where the CPU computes in it natively (AVX512-BF16 or AMX): elsewhere bf16
    is emulated and float32 is several times faster -- an AVX2 EPYC prefilled 1,024 tokens of the
    bench model in 6.4 s in float32 and 34 s in bfloat16, where an AMX Xeon takes about a second
    in bf16.
    """
    if dtype != "auto":
        return dtype, "as configured"
    if model_dir is not None and stored_dtype(model_dir) == "float32":
        return "float32", "the checkpoint is stored in float32"
    if cpuinfo is None:
        import torch

        if torch.cuda.is_available():
            return "auto", "GPU: the model's own dtype"
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    flags = next((ln.split(":", 1)[1].split() for ln in cpuinfo.splitlines()
                  if ln.startswith("flags")), [])
    native = [f for f in ("amx_bf16", "avx512_bf16") if f in flags]
    if native:
        return "bfloat16", f"this CPU computes bf16 natively ({', '.join(native)})"
    return "float32", "this CPU has no native bf16 (AVX512-BF16/AMX), where float32 is faster"


def on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def graphs(cfg: EngineConfig, gpu: bool) -> tuple[dict, str]:
    """The engine's CUDA graph settings for vLLM, and why (nothing on CPU or eagerly)."""
    if cfg.enforce_eager or not gpu:
        return {}, ""
    return compilation.graph_overrides(cfg.cudagraph_mode, cfg.kv_role, cfg.layered_load,
                                       cfg.max_num_seqs, cfg.speculative_tokens)


def engine_args(cfg: EngineConfig, gpu: bool | None = None) -> AsyncEngineArgs:
    """vLLM's arguments for `cfg`, on a GPU host or not (`gpu=None`: this host)."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    from splitserve.kv.control import EXTENSION

    kv_transfer = None
    if cfg.kv_role is not None:
        kv_transfer = KVTransferConfig(
            kv_connector="SplitServeConnector",
            kv_connector_module_path="splitserve.kv.connector",
            kv_role=cfg.kv_role,
            engine_id=cfg.engine_id,
            kv_connector_extra_config=cfg.kv_settings.to_extra(),
            kv_load_failure_policy=cfg.kv_failure_policy,
        )
    overrides, _ = graphs(cfg, on_gpu() if gpu is None else gpu)
    return AsyncEngineArgs(
        model=cfg.model,
        dtype=concrete_dtype(cfg.dtype, model_dir=cfg.model)[0],
        max_model_len=cfg.max_model_len,
        block_size=cfg.block_size,
        kv_cache_memory_bytes=cfg.kv_cache_mib << 20,
        kv_cache_dtype=cfg.kv_cache_dtype,
        gpu_memory_utilization=cfg.memory_fraction,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        enable_prefix_caching=cfg.enable_prefix_caching,
        enforce_eager=cfg.enforce_eager,
        **({"compilation_config": overrides} if overrides else {}),
        seed=cfg.seed,
        kv_transfer_config=kv_transfer,
        speculative_config=({"method": "ngram", "num_speculative_tokens": cfg.speculative_tokens,
                             "prompt_lookup_min": 2, "prompt_lookup_max": 5}
                            if cfg.speculative_tokens else None),
        # The worker server releases held KV and reads transfer states through the engine.
        worker_extension_cls=EXTENSION if cfg.kv_role is not None else "",
        disable_log_stats=False,
    )


# vLLM environment variables that silently replace one of our settings, and the setting each
# replaces. vLLM's CPU platform takes VLLM_CPU_KVCACHE_SPACE (GiB) over the engine's explicit
# `kv_cache_memory_bytes`, so a host where vLLM CPU users export it (as its docs tell them to)
# got 4,096 blocks of a 1 GiB cache where `--kv-cache-mib` and `splitserve plan` said 512.
OVERRIDING_ENV = {"VLLM_CPU_KVCACHE_SPACE": "kv_cache_mib"}


def claim_environment(cfg: EngineConfig, environ: dict[str, str] | None = None) -> list[str]:
    """Remove from `environ` (os.environ by default) every vLLM variable that would override one
    of `cfg`'s settings in the engine's processes, which inherit it: our setting wins, and the
    engine gets it explicitly (`engine_args`). Returns one line per variable removed, naming both
    values, for the log."""
    env = os.environ if environ is None else environ
    said = []
    for name, field_name in OVERRIDING_ENV.items():
        value = env.pop(name, None)
        if value:
            said.append(f"{name}={value} ignored: {field_name}={getattr(cfg, field_name)} is "
                        f"this engine's setting (--{field_name.replace('_', '-')})")
    return said


def build_engine(cfg: EngineConfig, monitor: EngineMonitor | None = None) -> AsyncLLM:
    """Start a vLLM AsyncLLM (its engine core runs in a spawned child process).

    With a `monitor`, every engine step's stats land in it (load, KV usage, transfers).
    """
    from vllm.v1.engine.async_llm import AsyncLLM

    # The engine core is spawned; callers' entry points must be under `if __name__ == "__main__"`.
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    # The engine core's wait for its worker process to exit (vLLM's default 5 s; see
    # SHUTDOWN_GRACE_S, which must stay longer).
    os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "15")
    # Read by the engine's worker process, which inherits our environment when it is spawned.
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cfg.cpu_cores
    # The engine stops if we die, even by SIGKILL (splitserve/lifeline.py, as a vLLM plugin).
    os.environ[ENGINE_PARENT_ENV] = str(os.getpid())
    os.environ[SPIN_ENV] = str(cfg.spin_s)  # for the spin plugin in the engine's processes
    for line in claim_environment(cfg):
        log.warning("%s", line)
    gpu = on_gpu()
    os.environ.update(compilation.compile_env(cfg.compile_cache_dir))
    if cfg.kv_settings.secret:  # not in vLLM's config, which it logs: its processes inherit this
        os.environ[KV_SECRET_ENV] = cfg.kv_settings.secret
    log.info("starting vLLM engine: model=%s dtype=%s kv_role=%s; %s", cfg.model, cfg.dtype,
             cfg.kv_role, compilation.describe(cfg.enforce_eager, gpu, graphs(cfg, gpu)[1],
                                               os.environ))
    loggers = [monitor.factory] if monitor is not None else None
    engine = AsyncLLM.from_engine_args(engine_args(cfg, gpu), stat_loggers=loggers)
    if engine.vllm_config.device_config.device_type == "cpu":
        lower_engine_core(cfg.engine_core_nice)  # (splitserve/engine_core.py)
    return engine


# How long vLLM may take to stop an engine before it kills the engine's processes. vLLM's own
# default is 5 s; its engine core alone waits up to 5 s for its worker process, and on a busy
# 2-core host that worker took longer to exit, so vLLM killed them: the shared memory of their
# message queues was never unlinked ("leaked shared_memory objects" at exit).
SHUTDOWN_GRACE_S = 20.0


def stop_engine(engine: AsyncLLM) -> None:
    engine.shutdown(timeout=SHUTDOWN_GRACE_S)


@contextmanager
def running_engine(cfg: EngineConfig, monitor: EngineMonitor | None = None
                   ) -> Iterator[AsyncLLM]:
    """An engine that is shut down on exit, whatever happens inside."""
    engine = build_engine(cfg, monitor)
    try:
        yield engine
    finally:
        stop_engine(engine)
        # AsyncLLM.__del__ shuts down again; left to interpreter teardown it trips over
        # half-unloaded modules. Collect it now, while everything is still importable.
        del engine
        gc.collect()


def token_prompt(ids: list[int]):
    """Token ids as the engine input vLLM's renderer would make of them. A plain
    `{"prompt_token_ids": ...}` dict is a "raw prompt" to vLLM 0.32, deprecated: each engine
    warned once on its first request."""
    from vllm.inputs import tokens_input

    return tokens_input(ids)


def spread_cores(index: int) -> str:
    """The core for the `index`-th engine on this host: engines take the cores round-robin."""
    cores = sorted(os.sched_getaffinity(0))
    return str(cores[index % len(cores)])
