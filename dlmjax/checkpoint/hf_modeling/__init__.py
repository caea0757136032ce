"""Files dlmjax ships inside its Hugging Face exports (modeling_dlmjax.py), kept as package data."""
