"""Orchestration library for the repository's BLS models, plus the repository's model contract.

Importable without Triton: code that touches ``triton_python_backend_utils`` lives only in the
modules that say so, and in the models' ``model.py`` files.
"""
