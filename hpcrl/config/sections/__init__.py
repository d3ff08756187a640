"""The config sections, one module per role; hpcrl.config.schema re-exports every public name."""
