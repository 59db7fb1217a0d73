"""Reports: versioned JSON (schema.py), terminal (console.py), HTML with plots (html.py)."""
