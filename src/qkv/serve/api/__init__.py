"""OpenAI's API shapes: request bodies checked into dataclasses, responses built from the engine's
events, chat messages, structured output, tools, logprob tokens, the tokenizer routes."""
