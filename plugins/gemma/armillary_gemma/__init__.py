"""armillary-gemma: Gemma 3 and Gemma 4 text models for armillary."""
