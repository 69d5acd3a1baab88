"""Cloud providers behind one narrow interface; each SDK is imported lazily inside its own module."""
