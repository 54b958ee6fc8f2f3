"""The features a request must ask for (engine/features.py's table says which field asks for which)."""
