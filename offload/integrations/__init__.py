"""Optional integrations with other libraries' training loops (the top layer).

Each subpackage imports its library lazily or not at all, so `import offload` and the
core never need it: `offload.integrations.hf` for Hugging Face (`pip install -e ".[hf]"`).
"""
