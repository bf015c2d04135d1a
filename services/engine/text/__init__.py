"""The tokenizer side of the engine, which the router shares (no torch): finding and
reading a model's files, the tokenizer and chat template, JSON-schema checks."""
