"""Model names hpcrl builds itself instead of downloading: name -> preset of hpcrl.models.tiny.

Its own module because both the builder (tiny.resolve_model) and the Hub code (hub.hub_ids: which
names need a download) need the table, and the builder calls the Hub code.
"""

# "preset" or "preset:template" (hpcrl.models.tiny.TEMPLATES; chatml when absent).
BUILTIN_MODELS = {
    "hpcrl/tiny-qwen3": "tiny",
    "hpcrl/small-qwen3": "small",
    "hpcrl/tiny-qwen3-think": "tiny:qwen3",
    "hpcrl/small-qwen3-think": "small:qwen3",
    "hpcrl/tiny-qwen3-moe": "tiny-moe",
    "hpcrl/small-qwen3-moe": "small-moe",
    "hpcrl/deep-qwen3-moe": "deep-moe",  # Qwen3-30B-A3B's routing shape (48 layers, 128 experts, top-8)
    "hpcrl/tiny-qwen3-151k": "tiny-151k",  # Qwen3's vocabulary size, for long-sequence memory tests
}
