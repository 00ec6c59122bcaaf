"""Known base models with their published EAGLE draft heads, and how much
memory each needs at 4, 8 and 16 bits, in GB of 10^9 bytes (as memory is
measured for the Models tab: app/library.detected_memory)."""

from __future__ import annotations

from dataclasses import dataclass

from models import bundled

RUNTIME_OVERHEAD_GB = 1.0  # CUDA context, activations and a 2k-token KV cache, roughly
CONSUMER_GPU_NAME = "12 GB"  # the design's target card, as it is sold (RTX 3060 12 GB) ...
CONSUMER_GPU_GB = 12 * 2**30 / 1e9  # ... which is 12 GiB


@dataclass(frozen=True)
class CatalogEntry:
    name: str  # shown in the UI
    base: str | None  # Hugging Face repo id of the base model; None = the bundled default
    head: str | None  # repo id of its EAGLE head; None = the bundled head (when present)
    parameters: float  # base-model parameters, billions
    head_parameters: float  # draft-head parameters, billions (one decoder layer + fc; EAGLE-3 adds its own lm_head)
    kind: str = "EAGLE-2"  # head format: EAGLE-2 (EAGLE-1/2 checkpoints) or EAGLE-3
    embedding_parameters: float = 0.0  # of `parameters`, billions: the embedding and an untied lm_head, kept at 16 bits when quantized
    # billions: the base's input embedding, which published EAGLE-1/2 checkpoints carry and the head loads as its own copy
    head_embedding: float = 0.0


CATALOG = (
    CatalogEntry(bundled.DEFAULT_NAME + " (bundled)", None, None, 0.135, 0.005, embedding_parameters=0.028),
    CatalogEntry("Llama-3.1-8B-Instruct (EAGLE-3)", "meta-llama/Llama-3.1-8B-Instruct", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", 8.03, 0.42, "EAGLE-3", 1.05),
    CatalogEntry("DeepSeek-R1-Distill-Llama-8B (EAGLE-3)", "deepseek-ai/DeepSeek-R1-Distill-Llama-8B", "yuhuili/EAGLE3-DeepSeek-R1-Distill-LLaMA-8B", 8.03, 0.42, "EAGLE-3", 1.05),
    CatalogEntry("Qwen3-8B (EAGLE-3, community head)", "Qwen/Qwen3-8B", "AngelSlim/Qwen3-8B_eagle3", 8.19, 0.40, "EAGLE-3", 1.24),
    CatalogEntry("Llama-3.3-70B-Instruct (EAGLE-3)", "meta-llama/Llama-3.3-70B-Instruct", "yuhuili/EAGLE3-LLaMA3.3-Instruct-70B", 70.6, 1.4, "EAGLE-3", 2.10),
    CatalogEntry("Vicuna-13B v1.3 (EAGLE-3)", "lmsys/vicuna-13b-v1.3", "yuhuili/EAGLE3-Vicuna1.3-13B", 13.0, 0.6, "EAGLE-3", 0.33),
    CatalogEntry("Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B-Instruct", "yuhuili/EAGLE-LLaMA3.1-Instruct-8B", 8.03, 0.25, embedding_parameters=1.05, head_embedding=0.525),
    CatalogEntry("Vicuna-7B v1.3", "lmsys/vicuna-7b-v1.3", "yuhuili/EAGLE-Vicuna-7B-v1.3", 6.74, 0.24, embedding_parameters=0.26, head_embedding=0.131),
    CatalogEntry("Vicuna-13B v1.3", "lmsys/vicuna-13b-v1.3", "yuhuili/EAGLE-Vicuna-13B-v1.3", 13.0, 0.37, embedding_parameters=0.33, head_embedding=0.164),
    CatalogEntry("Qwen2-7B-Instruct", "Qwen/Qwen2-7B-Instruct", "yuhuili/EAGLE-Qwen2-7B-Instruct", 7.62, 0.26, embedding_parameters=1.09, head_embedding=0.545),
    CatalogEntry("Llama-2-7B-chat", "meta-llama/Llama-2-7b-chat-hf", "yuhuili/EAGLE-llama2-chat-7B", 6.74, 0.24, embedding_parameters=0.26, head_embedding=0.131),
    CatalogEntry("Llama-2-13B-chat", "meta-llama/Llama-2-13b-chat-hf", "yuhuili/EAGLE-llama2-chat-13B", 13.0, 0.37, embedding_parameters=0.33, head_embedding=0.164),
)


def estimated_gb(entry: CatalogEntry, bits: int) -> float:
    """The decoder's weights at `bits`; the embedding, an untied lm_head and
    the head (with the embedding its checkpoint carries) at 16 bits
    (quantization keeps them so); plus runtime overhead."""
    decoder = entry.parameters - entry.embedding_parameters
    return decoder * bits / 8 + (entry.embedding_parameters + entry.head_parameters + entry.head_embedding) * 2 + RUNTIME_OVERHEAD_GB


def cpu_load_gb(entry: CatalogEntry, weight_bytes: int) -> float:
    """Loading's peak on a CPU: transformers reads the whole model and the head
    in the dtype they compute in (float32, 4 bytes a weight, on CPUs without
    native bf16) before Kestrel's int4 or int8 replace the decoder's linears."""
    return (entry.parameters + entry.head_parameters + entry.head_embedding) * weight_bytes + RUNTIME_OVERHEAD_GB


def fit(needed_gb: float, available_gb: float | None) -> str:
    """fits (with 15% to spare), tight, or does not fit."""
    if available_gb is None:
        return "unknown"
    if needed_gb <= 0.85 * available_gb:
        return "fits"
    return "tight" if needed_gb <= available_gb else "does not fit"


def find(name: str) -> CatalogEntry | None:
    return next((entry for entry in CATALOG if entry.name == name), None)
