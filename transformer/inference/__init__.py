"""From a trained model to translations and scores: search, the translator, CPU weight formats, CTranslate2, BLEU."""
