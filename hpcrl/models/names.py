"""Model names hpcrl builds itself instead of downloading: name -> preset of hpcrl.models.tiny.

Its own module because both the builder (tiny.resolve_model) and the Hub code (hub.hub_ids: which
names need a download) need the table, and the builder calls the Hub code.
"""

BUILTIN_MODELS = {
    "hpcrl/tiny-qwen3": "tiny",
    "hpcrl/small-qwen3": "small",
    "hpcrl/tiny-qwen3-151k": "tiny-151k",  # Qwen3's vocabulary size, for long-sequence memory tests
}
