"""The embedded demo worlds.

``digits`` (the main job): real handwritten digits (scikit-learn's 1,797 8x8 scans, shipped in
the package, no download) as text-to-image and image-to-video data, a digit classifier trained on
a held-out split, and the rewards built on it.

``text``: short strings rendered in a real font (:mod:`flowseam.demo.text`) as text-to-image
data, post-trained with ``flowgrpo`` on the ``ocr`` reward (:mod:`flowseam.demo.text_run`)."""
