"""Integrations with other libraries' training loops (`zero3.integrations.hf`: Hugging Face's Trainer)."""
