"""Model-based rewards that generate with posttrain's own models (the `judge` environment).

A part of its own, above `models` in the import layering: environments stay free of model code;
this one needs the generation engine. Registered like every built-in environment.
"""
