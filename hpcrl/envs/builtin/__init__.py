"""hpcrl's built-in environments (reverse-text, alphabet-sort, arithmetic, calculator, tool-think), reached by id through hpcrl.envs.registry."""
