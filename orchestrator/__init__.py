"""The orchestrator: one OpenAI/Anthropic URL in front of ctx and gen workers."""
