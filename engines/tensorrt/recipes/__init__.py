"""Built-in engine build recipes (*.toml, named by file stem); see engines/tensorrt/recipe.py for the keys."""
