"""Llama-family model definition and Hugging Face checkpoint loading (torch)."""
