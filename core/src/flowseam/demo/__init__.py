"""The embedded demo world: real handwritten digits (scikit-learn's 1,797 8x8 scans, shipped in
the package, no download) as text-to-image and image-to-video data, a digit classifier trained on
a held-out split, and the rewards built on it."""
