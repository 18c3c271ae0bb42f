"""Built-in engine build recipes (*.toml, named by file stem); see engines/recipe.py for the keys."""
