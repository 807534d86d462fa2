"""Training the shipped default models: corpus, tokenizer and target LM."""
