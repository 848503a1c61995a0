from __future__ import annotations

import numpy as np

from model.shapes import IMAGE_SIZE, SHAPE_CLASSES, luminance, make_sample, render_dataset


def test_classes_in_order() -> None:
    assert SHAPE_CLASSES == [
        "circle",
        "square",
        "triangle",
        "pentagon",
        "hexagon",
        "star",
        "cross",
        "ring",
        "crescent",
        "arrow",
    ]


def test_deterministic_from_seed() -> None:
    a, b, c = make_sample(3, 17), make_sample(3, 17), make_sample(4, 17)
    assert np.array_equal(np.asarray(a.image), np.asarray(b.image)) and a.label == b.label
    assert not np.array_equal(np.asarray(a.image), np.asarray(c.image))


def test_samples_are_64px_rgb_with_a_mask_inside_the_image() -> None:
    images, labels, masks = render_dataset(300, seed=0)
    assert images.shape == (300, IMAGE_SIZE, IMAGE_SIZE, 3) and images.dtype == np.uint8
    assert set(labels.tolist()) == set(range(10))  # every class appears
    areas = masks.reshape(300, -1).mean(1)
    assert areas.min() > 0.02 and areas.max() < 0.8
    for m in masks[:50]:  # the shape never touches the border from outside: it lies fully inside
        ys, xs = np.nonzero(m)
        assert ys.min() >= 0 and xs.max() < IMAGE_SIZE


def test_shape_contrasts_with_background() -> None:
    for i in range(40):
        s = make_sample(9, i)
        img = np.asarray(s.image, dtype=np.float64)
        inside, outside = img[s.mask], img[~s.mask]
        # Filled shapes differ clearly on average; outlined ones at least on their brightest contrast.
        assert abs(luminance(inside) - luminance(outside)) > 0.02 or s.mask.sum() < 50


def test_images_vary() -> None:
    images, _, masks = render_dataset(50, seed=1)
    assert len({img.tobytes() for img in images}) == 50
    sizes = masks.reshape(50, -1).sum(1)
    assert sizes.max() > 3 * sizes.min()  # sizes range from 35 % to 85 % of the side


def test_a_background_without_a_shape_is_drawn_as_the_shapes_are() -> None:
    """Outlier exposure's images: the background, lines and effects of a sample, no shape; labelled NO_SHAPE."""
    from model.data import ShapesDataset
    from model.shapes import NO_SHAPE, make_background

    a, b = make_background(5, 3), make_background(5, 3)
    assert a.label == NO_SHAPE and not a.mask.any() and a.image.size == (IMAGE_SIZE, IMAGE_SIZE)
    assert np.array_equal(np.asarray(a.image), np.asarray(b.image))  # the same pair, the same image
    data = ShapesDataset(6, 0, outliers=4)
    assert (
        data.labels.tolist()[:6] == [make_sample(0, i).label for i in range(6)] and data.labels.tolist()[6:] == [-1] * 4
    )
    assert not data.masks[6:].any()


def test_natural_textures_have_a_photographs_falling_spectrum() -> None:
    """Power at low spatial frequencies far above that at high ones (1/f^a, a from 1.5 to 3), unlike the uniform
    noise background, whose spectrum is flat."""
    from model.shapes import natural_texture

    rng = np.random.default_rng(0)
    for _ in range(5):
        img = natural_texture(rng, IMAGE_SIZE, contrast=40)
        assert img.shape == (IMAGE_SIZE, IMAGE_SIZE, 3) and img.min() >= 0 and img.max() <= 255
        power = np.abs(np.fft.fft2(img.mean(-1) - img.mean())) ** 2
        f = np.hypot(*np.meshgrid(np.fft.fftfreq(IMAGE_SIZE), np.fft.fftfreq(IMAGE_SIZE), indexing="ij"))
        assert power[(f > 0) & (f < 0.05)].mean() > 30 * power[f > 0.3].mean()


def test_irregular_regions_are_rounded_and_leave_no_mask() -> None:
    from model.shapes import NO_SHAPE, irregular_blobs, make_background

    rng = np.random.default_rng(1)
    flat = np.full((IMAGE_SIZE, IMAGE_SIZE, 3), 128.0)
    drawn = irregular_blobs(rng, flat)
    assert (np.abs(drawn - flat).sum(-1) > 30).mean() > 0.02  # something was drawn, in a contrasting colour
    samples = [make_background(9, i) for i in range(40)]
    assert all(s.label == NO_SHAPE and not s.mask.any() for s in samples)
    assert len({np.asarray(s.image).tobytes() for s in samples}) == 40


def test_specks_are_small_marks_on_any_background() -> None:
    """The clutter the spec allows: three to twelve squares or dots, none wider than 7 px, the rest untouched."""
    from scipy import ndimage

    from model.shapes import specks

    for seed in range(20):
        flat = np.full((IMAGE_SIZE, IMAGE_SIZE, 3), 128.0)
        changed = (specks(np.random.default_rng(seed), flat) != flat).any(-1)
        assert 0 < changed.sum() <= 12 * 7 * 7  # at most twelve marks of at most 7 x 7 px
        _, count = ndimage.label(changed)
        assert 1 <= count <= 12  # marks may overlap


def circle_outlines(n: int) -> list[tuple[float, float]]:
    """(radius, stroke) of `n` outlined circles as `render_shape` draws them, in px of the 64 px image: the
    radius from the silhouette's area, the stroke from the outline's (the narrowest reading, a band about the
    edge, where the stroke may lie inside it)."""
    from model.shapes import SUPERSAMPLE, render_shape

    rng, out = np.random.default_rng(7), []
    while len(out) < n:
        coverage, silhouette = render_shape(SHAPE_CLASSES.index("circle"), rng)
        drawn = np.asarray(coverage) >= 128
        if np.array_equal(drawn, np.asarray(silhouette) >= 128):
            continue  # filled
        r = float(np.sqrt((np.asarray(silhouette) >= 128).sum() / np.pi)) / SUPERSAMPLE
        out.append((r, float(drawn.sum()) / SUPERSAMPLE**2 / (2 * np.pi * r)))
    return out


def test_outlines_are_2_to_6_px_at_every_size() -> None:
    """The spec: a stroke of 2 to 6 px whatever the shape's size, so a small shape is drawn with thick outlines
    too."""
    outlined = circle_outlines(120)
    small = [s for r, s in outlined if r < 0.45 * IMAGE_SIZE / 2]
    assert min(s for _, s in outlined) > 1.5 and max(s for _, s in outlined) < 6.5
    assert small and max(small) > 4.5


def ring_band(mask: np.ndarray) -> float:
    """A ring's band in px, from its mask: the farthest of its pixels from its centre less the nearest."""
    ys, xs = np.nonzero(mask)
    d = np.hypot(ys - ys.mean(), xs - xs.mean())
    return float(d.max() - d.min())


def test_a_rings_band_is_wider_than_the_thickest_outline_at_every_size() -> None:
    """No image is both a valid outlined circle (stroke up to 6 px) and a valid ring, the smallest included."""
    from model.shapes import STROKE_RANGE

    ring = SHAPE_CLASSES.index("ring")
    rings = [s for s in (make_sample(11, i) for i in range(600)) if s.label == ring]
    extents = [np.ptp(np.nonzero(s.mask)[0]) + 1 for s in rings]
    assert len(rings) > 30 and min(extents) < 0.45 * IMAGE_SIZE  # small rings among them
    assert min(ring_band(s.mask) for s in rings) > STROKE_RANGE[1] + 1  # wider by more than a pixel
