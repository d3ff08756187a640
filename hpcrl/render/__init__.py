"""Tokenization through the `renderers` package: one place used by rollouts, SFT, eval and GEPA.

    select.py   [orchestrator.renderer] / [renderer] -> a renderers config and a Renderer (pure
                resolution of "auto", the --dry-run checks, the missing-package message)
    client.py   the multi-turn ChatClient: turn 1 rendered, later turns bridged onto the sampled ids
                (`bridge_to_next_turn`), sampled through POST /inference/v1/generate, completions
                parsed by the renderer (reasoning, tool calls)
    sft.py      loss masks from the renderer's training-sample builder

docs/renderers.md is the user's page.
"""
