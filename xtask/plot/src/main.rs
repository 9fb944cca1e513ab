//! Draws the plots of `cargo xtask bench`: `xtask-plot FONT OUT_DIR` reads on stdin a JSON
//! array of `{"stem", "title", "lines": {mode: [[block size, MiB/s], ...]}}` and writes
//! `OUT_DIR/<stem>.png` and `.svg` for each, MiB/s against block size (log scale), a line per
//! mode. A program of its own so that xtask's other commands (`test-vm`, `ci`) compile no
//! plotting library.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::Context;
use plotters::prelude::*;

/// A plot's lines: mode -> (block size, MiB/s) points.
type Lines = BTreeMap<String, Vec<(u64, f64)>>;

fn main() -> anyhow::Result<()> {
    let args = std::env::args().skip(1).collect::<Vec<_>>();
    let [font_path, out_dir] = args.as_slice() else {
        anyhow::bail!("usage: xtask-plot FONT OUT_DIR < plots.json");
    };
    let font = std::fs::read(font_path)
        .with_context(|| format!("cannot read the plot font {font_path}"))?;
    // The font must outlive every drawing: leak the one copy.
    let font: &'static [u8] = Box::leak(font.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, font)
        .map_err(|_| anyhow::format_err!("cannot load {font_path}"))?;
    let plots: serde_json::Value =
        serde_json::from_reader(std::io::stdin()).context("cannot parse the plots on stdin")?;
    let out_dir = PathBuf::from(out_dir);
    std::fs::create_dir_all(&out_dir)
        .with_context(|| format!("cannot create {}", out_dir.display()))?;
    for plot in plots.as_array().context("the plots are not a JSON array")? {
        let stem = plot["stem"].as_str().context("a plot without a stem")?;
        let title = plot["title"].as_str().unwrap_or(stem);
        let lines = serde_json::from_value::<Lines>(plot["lines"].clone())
            .with_context(|| format!("plot {stem}: its lines are not mode -> [[x, y], ...]"))?;
        let png = out_dir.join(format!("{stem}.png"));
        draw(
            BitMapBackend::new(&png, (900, 560)).into_drawing_area(),
            title,
            &lines,
        )
        .with_context(|| format!("cannot draw {}", png.display()))?;
        let svg = out_dir.join(format!("{stem}.svg"));
        draw(
            SVGBackend::new(&svg, (900, 560)).into_drawing_area(),
            title,
            &lines,
        )
        .with_context(|| format!("cannot draw {}", svg.display()))?;
    }
    Ok(())
}

/// Block sizes are powers of two: the x axis is their log2, labelled in bytes.
fn log2(bytes: u64) -> f64 {
    (bytes.max(1) as f64).log2()
}

/// A block size as xtask's tables print it: `4K`, `1M`.
fn human(bytes: u64) -> String {
    if bytes >= 1 << 20 {
        format!("{}M", bytes >> 20)
    } else {
        format!("{}K", bytes >> 10)
    }
}

fn draw<DB: DrawingBackend>(
    area: DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    modes: &Lines,
) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    area.fill(&WHITE)
        .map_err(|e| anyhow::format_err!("{e:?}"))?;
    let xs = modes
        .values()
        .flatten()
        .map(|(x, _)| *x)
        .collect::<Vec<_>>();
    let (x_min, x_max) = (
        xs.iter().min().copied().unwrap_or(4096),
        xs.iter().max().copied().unwrap_or(1 << 26),
    );
    let y_max = modes
        .values()
        .flatten()
        .map(|(_, y)| *y)
        .fold(1.0, f64::max)
        * 1.15;
    let mut chart = ChartBuilder::on(&area)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(log2(x_min) - 0.3..log2(x_max) + 0.3, 0.0..y_max)
        .map_err(|e| anyhow::format_err!("{e:?}"))?;
    chart
        .configure_mesh()
        .x_desc("block size (log scale)")
        .y_desc("MiB/s")
        .x_labels((log2(x_max) - log2(x_min)) as usize + 1)
        .x_label_formatter(&|x| {
            if (x - x.round()).abs() < 1e-6 {
                human(2f64.powf(*x) as u64)
            } else {
                String::new()
            }
        })
        .draw()
        .map_err(|e| anyhow::format_err!("{e:?}"))?;
    let colors = [&BLUE, &RED, &GREEN, &MAGENTA];
    for (i, (mode, points)) in modes.iter().enumerate() {
        let color = colors[i % colors.len()];
        let mut pts = points
            .iter()
            .map(|(x, y)| (log2(*x), *y))
            .collect::<Vec<_>>();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
            .map_err(|e| anyhow::format_err!("{e:?}"))?
            .label(mode.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        chart
            .draw_series(pts.iter().map(|p| Circle::new(*p, 3, color.filled())))
            .map_err(|e| anyhow::format_err!("{e:?}"))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| anyhow::format_err!("{e:?}"))?;
    area.present().map_err(|e| anyhow::format_err!("{e:?}"))?;
    Ok(())
}
