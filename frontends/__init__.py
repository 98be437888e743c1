"""HTTP frontends: OpenAI and Anthropic APIs, tokenization, the engine client.

Never imports torch: frontends start in about a second and stay small.
"""
