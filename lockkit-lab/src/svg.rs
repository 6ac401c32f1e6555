//! One scenario run's timeline as a picture: a self-contained SVG (no scripts, no external
//! fonts or images) that GitHub shows inline, with a lane for what the lab broke, one for
//! the holder and one for the rival, on a time axis in seconds.
//!
//! Tests find what a picture shows by its elements' classes, so these are promised:
//! `lease` (a span in which an actor held the lock; `lease expired` for the part after its
//! lease ran out while it still believed it held it), `fault` (a window in which something
//! was broken), `double-grant` (both believed they held the lock at once), and `marker`
//! with one of `grant`, `renewed`, `renew-failed`, `lease-end`, `lost`, `released`,
//! `denied`, `write-accepted`, `write-refused`, `write-stale-accepted`, `server`. Markers
//! carry `data-actor` (`holder`, `rival`, `lab`) and `data-t` (seconds from the start);
//! the root carries `data-scenario`, `data-backend`, `data-double-grant`, `data-lost` and
//! `data-stale` (the run's outcome).

use std::{collections::BTreeMap, fmt::Write as _};

use lockkit_core::Consistency;

use crate::{
    find,
    report::{LostSignal, Report, Stale},
    timeline::{Actor, Event, Mark, WriteOutcome},
};

/// The picture's width in pixels.
pub const WIDTH: f64 = 800.0;
/// Where time 0 is drawn.
const PLOT_LEFT: f64 = 118.0;
/// Where the last moment is drawn.
const PLOT_RIGHT: f64 = 772.0;
const FONT: &str = "Helvetica, Arial, DejaVu Sans, sans-serif";
/// The label text size; the estimate of a character's width in it.
const TEXT: f64 = 11.0;
const CHAR: f64 = 6.2;
const HOLDER: &str = "#2f6fdb";
const RIVAL: &str = "#8a3ffc";
const FAULT: &str = "#e8590c";
const GREEN: &str = "#2b8a3e";
const RED: &str = "#c92a2a";
const INK: &str = "#212529";
const MUTED: &str = "#495057";

/// The file a run's picture is written to: `holder-paused-redis.svg`.
pub fn file_name(scenario: &str, backend: &str) -> String {
    format!("{scenario}-{backend}.svg")
}

/// What the run showed, in a sentence or three, from its outcome only (no timings or
/// tokens), so two runs that behave the same are described the same.
pub fn caption(report: &Report) -> String {
    let Some(seen) = &report.observed else {
        return format!(
            "The run stopped before it could be judged: {}",
            report
                .problems
                .first()
                .map_or("no reason given", String::as_str)
        );
    };
    let mut out = String::new();
    if !report.passed() {
        out.push_str("FAILED (not what this scenario expects). ");
    }
    out.push_str(match (seen.double_grant, seen.lost) {
        (true, _) if report.expect.double_grant => {
            "The rival was granted the lock while the holder still believed it held it: a \
             double grant, the hazard this scenario shows."
        }
        (true, _) => {
            "The rival was granted the lock while the holder still believed it held it: an \
             UNEXPECTED double grant."
        }
        (false, LostSignal::AfterRival) => {
            "The rival was granted the lock only after the holder's lease had run out (no \
             double grant), but the holder did not know yet."
        }
        (false, LostSignal::BeforeRival) => {
            "The holder's guard signalled the loss before the rival was granted the lock: no \
             double grant."
        }
        (false, LostSignal::Never) => {
            "The holder kept the lock through the fault; the rival got it only after the \
             holder released it: no double grant."
        }
    });
    if seen.double_grant && seen.lost == LostSignal::AfterRival {
        out.push_str(" The holder learned of its loss only after the rival's grant.");
    }
    let guard = find(report.scenario, report.backend).map_or("the fence", |d| d.store().guard());
    match seen.stale {
        Stale::Refused => out.push_str(&format!(
            " Its late write with the older token was refused by {guard}."
        )),
        Stale::Accepted => {
            out.push_str(" Its late write with the older token was ACCEPTED: fencing failed.")
        }
        Stale::NoStaleHolder => {}
    }
    out
}

/// The run's timeline as a self-contained SVG document (see the module's documentation for
/// the classes tests may rely on).
pub fn render(report: &Report) -> String {
    Picture::new(report).draw()
}

/// `text` with the five XML specials escaped, for text and attribute values.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            // Characters XML 1.0 does not allow at all.
            c if (c as u32) < 0x20 && !matches!(c, '\t' | '\n' | '\r') => out.push(' '),
            c => out.push(c),
        }
    }
    out
}

/// `text` cut into lines of at most `width` characters, at spaces.
fn wrap(text: &str, width: usize) -> Vec<String> {
    let mut lines: Vec<String> = Vec::new();
    let mut line = String::new();
    for word in text.split_whitespace() {
        if !line.is_empty() && line.chars().count() + 1 + word.chars().count() > width {
            lines.push(std::mem::take(&mut line));
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
    }
    if !line.is_empty() {
        lines.push(line);
    }
    lines
}

/// The estimated width of `text` in label type.
fn text_width(text: &str) -> f64 {
    text.chars().count() as f64 * CHAR
}

/// A span in which an actor held the lock, in seconds.
#[derive(Debug, Clone)]
struct Span {
    from: f64,
    to: f64,
    /// When its lease ran out while it still believed it held the lock.
    expired_from: Option<f64>,
}

/// A window in which something was broken, in seconds.
#[derive(Debug, Clone)]
struct Window {
    from: f64,
    to: f64,
    label: String,
    text: String,
    /// Which bar row of the lab's lane it is drawn in.
    row: usize,
}

/// A point on a lane: its symbol, time, label and sentence.
#[derive(Debug, Clone)]
struct Point {
    class: &'static str,
    t: f64,
    label: String,
    text: String,
}

/// A label placed in a lane's label rows.
#[derive(Debug, Clone)]
struct Placed {
    x: f64,
    /// Where the label's connector starts (the marker's centre).
    from_y: f64,
    text: String,
    row: usize,
    end_anchored: bool,
    color: &'static str,
}

/// Which lane something is drawn in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LaneId {
    Lab,
    Holder,
    Rival,
}

impl LaneId {
    fn actor(self) -> &'static str {
        match self {
            LaneId::Lab => "lab",
            LaneId::Holder => "holder",
            LaneId::Rival => "rival",
        }
    }
}

/// What a lane holds once the timeline is read.
#[derive(Debug, Default)]
struct LaneContent {
    spans: Vec<Span>,
    points: Vec<Point>,
}

/// The picture being drawn: the run, read into spans, windows and points.
struct Picture<'a> {
    report: &'a Report,
    /// The first and last moments drawn, in seconds.
    start: f64,
    end: f64,
    holder: LaneContent,
    rival: LaneContent,
    lab: LaneContent,
    windows: Vec<Window>,
    /// Where both held the lock at once (drawn only when the run saw a double grant).
    overlaps: Vec<(f64, f64)>,
    warp: Warp,
    out: String,
}

impl<'a> Picture<'a> {
    fn new(report: &'a Report) -> Self {
        let last = report
            .timeline
            .iter()
            .map(|e| e.at.as_secs_f64())
            .fold(0.0, f64::max);
        let first = report
            .timeline
            .iter()
            .filter(|e| e.mark != Mark::Note)
            .map(|e| e.at.as_secs_f64())
            .fold(f64::INFINITY, f64::min);
        let first = if first.is_finite() { first } else { 0.0 };
        let end = (last + (last - first) * 0.04).max(first + 1.0);
        // Set-up before the first drawn event is left out, from a whole tick on.
        let step = tick_step(end - first);
        let start = (first / step).floor() * step;
        let mut picture = Picture {
            report,
            start,
            end,
            holder: LaneContent::default(),
            rival: LaneContent::default(),
            lab: LaneContent::default(),
            windows: Vec::new(),
            overlaps: Vec::new(),
            warp: Warp::new(Vec::new(), start, end),
            out: String::new(),
        };
        picture.read(&report.timeline);
        picture.overlaps = picture.find_overlaps();
        picture.warp = Warp::new(picture.moments(), start, end);
        picture
    }

    /// Where both believed they held the lock at once, if the run saw a double grant.
    fn find_overlaps(&self) -> Vec<(f64, f64)> {
        if !self
            .report
            .observed
            .as_ref()
            .is_some_and(|s| s.double_grant)
        {
            return Vec::new();
        }
        let mut overlaps = Vec::new();
        for a in &self.holder.spans {
            let a_to = a.expired_from.unwrap_or(a.to).min(a.to);
            for b in &self.rival.spans {
                let b_to = b.expired_from.unwrap_or(b.to).min(b.to);
                let (from, to) = (a.from.max(b.from), a_to.min(b_to));
                if to > from {
                    overlaps.push((from, to));
                }
            }
        }
        overlaps
    }

    fn lane(&mut self, who: Actor) -> &mut LaneContent {
        match who {
            Actor::Holder => &mut self.holder,
            Actor::Rival => &mut self.rival,
        }
    }

    /// Reads the timeline into spans, windows and points.
    fn read(&mut self, timeline: &[Event]) {
        let end = self.end;
        let mut open: BTreeMap<u32, Window> = BTreeMap::new();
        let mut closed: Vec<Window> = Vec::new();
        for event in timeline {
            let t = event.at.as_secs_f64();
            let point = |class: &'static str, label: String| Point {
                class,
                t,
                label,
                text: event.text.clone(),
            };
            match &event.mark {
                Mark::Note => {}
                Mark::Granted { who, token } => {
                    let lane = self.lane(*who);
                    close_span(lane, t);
                    lane.spans.push(Span {
                        from: t,
                        to: f64::NAN,
                        expired_from: None,
                    });
                    lane.points
                        .push(point("grant", format!("granted, token {token}")));
                }
                Mark::Renewed { who } => {
                    self.lane(*who)
                        .points
                        .push(point("renewed", "renewed".into()));
                }
                Mark::RenewFailed { who } => {
                    self.lane(*who)
                        .points
                        .push(point("renew-failed", "renewal refused".into()));
                }
                Mark::LeaseEnds { who } => {
                    let lane = self.lane(*who);
                    if let Some(span) = lane.spans.last_mut().filter(|s| s.to.is_nan()) {
                        span.expired_from.get_or_insert(t);
                    }
                    lane.points
                        .push(point("lease-end", "its lease ran out".into()));
                }
                Mark::Lost { who } => {
                    let lane = self.lane(*who);
                    close_span(lane, t);
                    lane.points.push(point("lost", "guard signals LOST".into()));
                }
                Mark::Released { who } => {
                    let lane = self.lane(*who);
                    close_span(lane, t);
                    lane.points.push(point("released", "released".into()));
                }
                Mark::Denied { who, label } => {
                    self.lane(*who)
                        .points
                        .push(point("denied", format!("tries: {label}")));
                }
                Mark::Write { who, outcome, .. } => {
                    let (class, label) = match outcome {
                        WriteOutcome::Accepted => ("write-accepted", "write accepted"),
                        WriteOutcome::Refused => {
                            ("write-refused", "write with its old token REFUSED")
                        }
                        WriteOutcome::StaleAccepted => (
                            "write-stale-accepted",
                            "stale write ACCEPTED (fencing failed)",
                        ),
                    };
                    self.lane(*who).points.push(point(class, label.into()));
                }
                Mark::FaultBegins { id, label } => {
                    open.insert(
                        *id,
                        Window {
                            from: t,
                            to: end,
                            label: label.clone(),
                            text: event.text.clone(),
                            row: 0,
                        },
                    );
                }
                Mark::FaultEnds { id, label } => {
                    if let Some(mut window) = open.remove(id) {
                        window.to = t;
                        closed.push(window);
                    }
                    self.lab.points.push(point("server", label.clone()));
                }
                Mark::Server { label } => {
                    self.lab.points.push(point("server", label.clone()));
                }
            }
        }
        closed.extend(open.into_values());
        closed.sort_by(|a, b| a.from.total_cmp(&b.from));
        // Overlapping windows get rows of their own.
        let mut row_ends: Vec<f64> = Vec::new();
        for window in &mut closed {
            let row = row_ends
                .iter()
                .position(|e| *e <= window.from)
                .unwrap_or(row_ends.len());
            if row == row_ends.len() {
                row_ends.push(window.to);
            } else {
                row_ends[row] = window.to;
            }
            window.row = row;
        }
        self.windows = closed;
        for lane in [&mut self.holder, &mut self.rival] {
            close_span(lane, end);
        }
    }

    fn x(&self, t: f64) -> f64 {
        self.warp.x(t)
    }

    /// Every moment something is drawn at.
    fn moments(&self) -> Vec<f64> {
        let mut times: Vec<f64> = Vec::new();
        for lane in [&self.holder, &self.rival, &self.lab] {
            times.extend(lane.points.iter().map(|p| p.t));
            for span in &lane.spans {
                times.extend([span.from, span.to]);
                times.extend(span.expired_from);
            }
        }
        for window in &self.windows {
            times.extend([window.from, window.to]);
        }
        times
    }

    fn draw(mut self) -> String {
        let report = self.report;
        let consistency = match report.consistency {
            Some(Consistency::Cp) => " (CP)",
            Some(Consistency::Ap) => " (AP)",
            None => "",
        };
        let title = format!("{} on {}{consistency}", report.scenario, report.backend);
        let what = find(report.scenario, report.backend).map_or("", |d| d.what);
        let caption = caption(report);
        let what_lines = wrap(&format!("What the lab does: {what}"), 112);
        let caption_lines = wrap(&caption, 106);

        // Lay the lanes out first: their heights depend on their labels.
        let lanes_top = 44.0 + what_lines.len() as f64 * 16.0 + 10.0;
        let mut body = String::new();
        let mut y = lanes_top;
        let mut lane_boxes = Vec::new();
        for id in [LaneId::Lab, LaneId::Holder, LaneId::Rival] {
            let (svg, height) = self.draw_lane(id, y);
            lane_boxes.push((id, y, height));
            body.push_str(&svg);
            y += height;
        }
        let lanes_bottom = y;
        let axis_y = lanes_bottom + 4.0;
        let legend_y = axis_y + 54.0;
        let caption_y = legend_y + 52.0;
        let height = caption_y + caption_lines.len() as f64 * 16.0 + 8.0;

        let seen = report.observed.as_ref();
        let _ = write!(
            self.out,
            r##"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height:.0}" viewBox="0 0 {WIDTH} {height:.0}" font-family="{FONT}" role="img" aria-label="{aria}" data-scenario="{scenario}" data-backend="{backend}" data-double-grant="{double}" data-lost="{lost}" data-stale="{stale}">
<title>{title_text}</title>
<defs><pattern id="expired" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)"><rect width="6" height="6" fill="#ffffff"/><line x1="0" y1="0" x2="0" y2="6" stroke="{HOLDER}" stroke-width="2.5"/></pattern></defs>
<rect width="100%" height="100%" fill="#ffffff"/>
<text x="16" y="26" font-size="17" font-weight="bold" fill="{INK}">{title_esc}</text>
"##,
            aria = escape(&format!("{title}: {caption}")),
            scenario = escape(report.scenario),
            backend = escape(report.backend),
            double = seen.map_or("?", |s| if s.double_grant { "yes" } else { "no" }),
            lost = seen.map_or("?", |s| match s.lost {
                LostSignal::BeforeRival => "before-rival",
                LostSignal::AfterRival => "after-rival",
                LostSignal::Never => "never",
            }),
            stale = seen.map_or("?", |s| match s.stale {
                Stale::Refused => "refused",
                Stale::Accepted => "accepted",
                Stale::NoStaleHolder => "none",
            }),
            title_text = escape(&format!("{title}: {caption}")),
            title_esc = escape(&title),
        );
        for (i, line) in what_lines.iter().enumerate() {
            let _ = writeln!(
                self.out,
                r##"<text x="16" y="{:.0}" font-size="12" fill="{MUTED}">{}</text>"##,
                46.0 + i as f64 * 16.0,
                escape(line)
            );
        }
        // Lane backgrounds, then what spans lanes (grid, fault windows, double grant),
        // then the lanes' own drawings on top.
        for (i, (id, top, h)) in lane_boxes.iter().enumerate() {
            let fill = if i % 2 == 0 { "#f8f9fa" } else { "#ffffff" };
            let (name, sub) = match id {
                LaneId::Lab => ("lab / servers", "what broke"),
                LaneId::Holder => ("holder", "first to lock"),
                LaneId::Rival => ("rival", "wants it too"),
            };
            let _ = writeln!(
                self.out,
                r##"<rect x="8" y="{top:.1}" width="{w:.0}" height="{h:.1}" fill="{fill}" stroke="#dee2e6" stroke-width="1"/>
<text x="16" y="{ty:.1}" font-size="13" font-weight="bold" fill="{INK}">{name}</text>
<text x="16" y="{sy:.1}" font-size="11" fill="{MUTED}">{sub}</text>"##,
                w = WIDTH - 16.0,
                ty = top + 22.0,
                sy = top + 37.0,
            );
        }
        self.draw_grid(lanes_top, lanes_bottom);
        for window in self.windows.clone() {
            let (x1, x2) = (self.x(window.from), self.x(window.to));
            let _ = writeln!(
                self.out,
                r##"<rect class="fault-band" x="{x1:.1}" y="{lanes_top:.1}" width="{w:.1}" height="{h:.1}" fill="{FAULT}" fill-opacity="0.10"/>"##,
                w = (x2 - x1).max(2.0),
                h = lanes_bottom - lanes_top,
            );
        }
        self.draw_double_grant(&lane_boxes);
        self.out.push_str(&body);
        self.draw_axis(axis_y);
        self.draw_legend(legend_y);
        let _ = writeln!(
            self.out,
            r##"<text x="16" y="{caption_y:.0}" font-size="12" font-weight="bold" fill="{INK}">What happened</text>"##
        );
        for (i, line) in caption_lines.iter().enumerate() {
            let _ = writeln!(
                self.out,
                r##"<text x="16" y="{:.0}" font-size="12" fill="{INK}">{}</text>"##,
                caption_y + 16.0 + i as f64 * 16.0,
                escape(line)
            );
        }
        self.out.push_str("</svg>\n");
        self.out
    }

    /// Draws one lane from `top`; returns its drawing and its height.
    fn draw_lane(&self, id: LaneId, top: f64) -> (String, f64) {
        let mut out = String::new();
        let content = match id {
            LaneId::Lab => &self.lab,
            LaneId::Holder => &self.holder,
            LaneId::Rival => &self.rival,
        };
        let bar_rows = match id {
            LaneId::Lab => self.windows.iter().map(|w| w.row + 1).max().unwrap_or(1),
            _ => 1,
        };
        let bar_y = |row: usize| top + 30.0 + row as f64 * 22.0;
        let color = match id {
            LaneId::Lab => FAULT,
            LaneId::Holder => HOLDER,
            LaneId::Rival => RIVAL,
        };
        let mut labels: Vec<Placed> = Vec::new();
        // Bars.
        if id == LaneId::Lab {
            for window in &self.windows {
                let (x1, x2) = (self.x(window.from), self.x(window.to));
                let cy = bar_y(window.row);
                let w = (x2 - x1).max(3.0);
                let _ = writeln!(
                    out,
                    r##"<g class="fault" data-t="{:.3}" data-until="{:.3}"><title>{}</title><rect x="{x1:.1}" y="{:.1}" width="{w:.1}" height="16" rx="3" fill="{FAULT}"/>"##,
                    window.from,
                    window.to,
                    escape(&window.text),
                    cy - 8.0,
                );
                if text_width(&window.label) + 10.0 <= w {
                    let _ = writeln!(
                        out,
                        r##"<text x="{:.1}" y="{:.1}" font-size="{TEXT}" font-weight="bold" fill="#ffffff">{}</text>"##,
                        x1 + 5.0,
                        cy + 4.0,
                        escape(&window.label)
                    );
                } else {
                    labels.push(Placed {
                        x: x1,
                        from_y: cy,
                        text: window.label.clone(),
                        row: 0,
                        end_anchored: false,
                        color: FAULT,
                    });
                }
                out.push_str("</g>\n");
            }
        } else {
            let cy = bar_y(0);
            for span in &content.spans {
                let valid_to = span.expired_from.unwrap_or(span.to).min(span.to);
                let (x1, x2) = (self.x(span.from), self.x(valid_to));
                let w = (x2 - x1).max(2.0);
                let _ = writeln!(
                    out,
                    r##"<rect class="lease" data-t="{:.3}" data-until="{valid_to:.3}" x="{x1:.1}" y="{:.1}" width="{w:.1}" height="14" rx="3" fill="{color}" fill-opacity="0.85"/>"##,
                    span.from,
                    cy - 7.0
                );
                let text = "holds the lock";
                // In the widest stretch of the bar that no marker covers, if it fits.
                let mut edges: Vec<f64> = content
                    .points
                    .iter()
                    .map(|p| self.x(p.t))
                    .filter(|x| *x > x1 && *x < x1 + w)
                    .collect();
                edges.extend([x1, x1 + w]);
                edges.sort_by(f64::total_cmp);
                let room = edges
                    .windows(2)
                    .map(|e| (e[0] + 12.0, e[1] - 10.0))
                    .max_by(|a, b| (a.1 - a.0).total_cmp(&(b.1 - b.0)));
                if let Some((from, to)) = room.filter(|(a, b)| b - a >= text_width(text) + 8.0) {
                    let _ = writeln!(
                        out,
                        r##"<text x="{:.1}" y="{:.1}" font-size="{TEXT}" fill="#ffffff" font-weight="bold" text-anchor="middle">{text}</text>"##,
                        (from + to) / 2.0,
                        cy + 4.0
                    );
                }
                if let Some(expired) = span.expired_from.filter(|e| *e < span.to) {
                    let (e1, e2) = (self.x(expired), self.x(span.to));
                    let w = (e2 - e1).max(2.0);
                    let _ = writeln!(
                        out,
                        r##"<rect class="lease expired" data-t="{expired:.3}" data-until="{:.3}" x="{e1:.1}" y="{:.1}" width="{w:.1}" height="14" rx="3" fill="url(#expired)" stroke="{color}" stroke-width="1"/>"##,
                        span.to,
                        cy - 7.0
                    );
                    let text = "lease over, it still believes it holds";
                    if text_width(text) + 12.0 <= w {
                        let tw = text_width(text) + 8.0;
                        let _ = writeln!(
                            out,
                            r##"<rect x="{:.1}" y="{:.1}" width="{tw:.1}" height="12" fill="#ffffff" fill-opacity="0.9"/><text x="{:.1}" y="{:.1}" font-size="{TEXT}" fill="{color}" font-weight="bold">{text}</text>"##,
                            e1 + 4.0,
                            cy - 6.0,
                            e1 + 8.0,
                            cy + 4.0
                        );
                    }
                }
            }
        }
        // Points: on the bar line, or just above or below it when another is too close.
        // The lab's points get a row of their own under its bars.
        let line_y = match id {
            LaneId::Lab => bar_y(bar_rows) - 4.0,
            _ => bar_y(0),
        };
        let mut taken: Vec<(f64, usize)> = Vec::new();
        let mut points = content.points.clone();
        points.sort_by(|a, b| a.t.total_cmp(&b.t));
        for p in &points {
            let x = self.x(p.t);
            let slot = (0..3)
                .find(|s| {
                    !taken
                        .iter()
                        .any(|(tx, ts)| ts == s && (tx - x).abs() < 14.0)
                })
                .unwrap_or(0);
            taken.push((x, slot));
            let y = line_y + [0.0, -17.0, 17.0][slot];
            let _ = write!(
                out,
                r##"<g class="marker {}" data-actor="{}" data-t="{:.3}"><title>{}</title>"##,
                p.class,
                id.actor(),
                p.t,
                escape(&p.text)
            );
            out.push_str(&symbol(p.class, x, y, color));
            out.push_str("</g>\n");
            let label_color = match p.class {
                "write-refused" | "write-stale-accepted" | "renew-failed" => RED,
                "write-accepted" => GREEN,
                "lost" => FAULT,
                "server" | "denied" => MUTED,
                _ => color,
            };
            labels.push(Placed {
                x,
                from_y: y,
                text: p.label.clone(),
                row: 0,
                end_anchored: false,
                color: label_color,
            });
        }
        if id == LaneId::Rival {
            for (from, _) in &self.overlaps {
                labels.push(Placed {
                    x: self.x(*from),
                    from_y: line_y,
                    text: "DOUBLE GRANT: both believe they hold the lock".into(),
                    row: 0,
                    end_anchored: false,
                    color: RED,
                });
            }
        }
        // Labels: in rows under the bars, each in the first row where it fits.
        let rows = place(&mut labels);
        let first_row = line_y + 17.0 + 9.0 + TEXT;
        for label in &labels {
            let ly = first_row + label.row as f64 * 15.0;
            let _ = writeln!(
                out,
                r##"<line x1="{x:.1}" y1="{:.1}" x2="{x:.1}" y2="{:.1}" stroke="{}" stroke-width="0.8" stroke-dasharray="2,2"/>"##,
                label.from_y + 6.0,
                ly - TEXT + 1.0,
                label.color,
                x = label.x,
            );
            let _ = writeln!(
                out,
                r##"<text x="{:.1}" y="{ly:.1}" font-size="{TEXT}" fill="{}" text-anchor="{}">{}</text>"##,
                if label.end_anchored {
                    label.x + 3.0
                } else {
                    label.x - 3.0
                },
                label.color,
                if label.end_anchored { "end" } else { "start" },
                escape(&label.text)
            );
        }
        let height = (first_row + rows as f64 * 15.0 - top).max(52.0);
        (out, height)
    }

    /// The ticks of the time axis: whole steps of real time, and where they are drawn;
    /// a tick too close to the one before is left out.
    fn ticks(&self) -> Vec<(f64, f64)> {
        let step = self.tick_step();
        let mut ticks: Vec<(f64, f64)> = Vec::new();
        let mut i = (self.start / step - 1e-9).ceil();
        loop {
            // `+ 0.0` turns a -0 into 0, so no tick reads "-0 s".
            let t = i * step + 0.0;
            if t > self.end + 1e-9 {
                break;
            }
            let x = self.x(t);
            if ticks.last().is_none_or(|(_, last)| x - last >= 42.0) {
                ticks.push((t, x));
            }
            i += 1.0;
        }
        ticks
    }

    /// The time between two ticks: whole steps at least 50 pixels apart where time is
    /// drawn to scale.
    fn tick_step(&self) -> f64 {
        [0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0]
            .into_iter()
            .find(|s| s * self.warp.px_per_second >= 50.0)
            .unwrap_or(120.0)
    }

    /// Light vertical lines at each tick, across the lanes.
    fn draw_grid(&mut self, top: f64, bottom: f64) {
        for (_, x) in self.ticks() {
            let _ = writeln!(
                self.out,
                r##"<line x1="{x:.1}" y1="{top:.1}" x2="{x:.1}" y2="{bottom:.1}" stroke="#dee2e6" stroke-width="1"/>"##
            );
        }
    }

    /// The time axis under the lanes: solid where it is to scale, dashed where a short
    /// gap was stretched so close events stay apart.
    fn draw_axis(&mut self, y: f64) {
        let step = self.tick_step();
        self.out.push_str("<g class=\"axis\">\n");
        for (i, pair) in self.warp.knots.windows(2).enumerate() {
            let ((_, x1), (_, x2)) = (pair[0], pair[1]);
            let stretched = self.warp.stretched.get(i).copied().unwrap_or(false);
            let style = if stretched {
                r#"stroke-width="2.5" stroke-dasharray="2,2""#
            } else {
                r#"stroke-width="1""#
            };
            let _ = writeln!(
                self.out,
                r##"<line x1="{x1:.1}" y1="{y:.1}" x2="{x2:.1}" y2="{y:.1}" stroke="{INK}" {style}/>"##
            );
        }
        for (t, x) in self.ticks() {
            let label = if step < 1.0 {
                format!("{t:.1} s")
            } else {
                format!("{t:.0} s")
            };
            let _ = writeln!(
                self.out,
                r##"<line x1="{x:.1}" y1="{y:.1}" x2="{x:.1}" y2="{:.1}" stroke="{INK}" stroke-width="1"/><text x="{x:.1}" y="{:.1}" font-size="{TEXT}" fill="{INK}" text-anchor="middle">{label}</text>"##,
                y + 5.0,
                y + 17.0
            );
        }
        let _ = writeln!(
            self.out,
            r##"<line x1="{PLOT_LEFT}" y1="{ly:.1}" x2="{:.1}" y2="{ly:.1}" stroke="{INK}" stroke-width="2.5" stroke-dasharray="2,2"/><text x="{:.1}" y="{:.1}" font-size="{TEXT}" fill="{MUTED}">time stretched here, so close events stay apart</text>"##,
            PLOT_LEFT + 22.0,
            PLOT_LEFT + 28.0,
            y + 34.0,
            ly = y + 30.0,
        );
        let _ = writeln!(
            self.out,
            r##"<text x="{:.1}" y="{:.1}" font-size="{TEXT}" fill="{MUTED}" text-anchor="end">seconds since the scenario started</text></g>"##,
            PLOT_RIGHT,
            y + 34.0
        );
    }

    /// Where both believed they held the lock at once, across both lanes.
    fn draw_double_grant(&mut self, lanes: &[(LaneId, f64, f64)]) {
        let (Some(holder), Some(rival)) = (
            lanes.iter().find(|l| l.0 == LaneId::Holder),
            lanes.iter().find(|l| l.0 == LaneId::Rival),
        ) else {
            return;
        };
        for (from, to) in self.overlaps.clone() {
            let (x1, x2) = (self.x(from), self.x(to));
            let (top, bottom) = (holder.1, rival.1 + rival.2);
            let _ = writeln!(
                self.out,
                r##"<rect class="double-grant" data-t="{from:.3}" data-until="{to:.3}" x="{x1:.1}" y="{top:.1}" width="{w:.1}" height="{h:.1}" fill="{RED}" fill-opacity="0.13" stroke="{RED}" stroke-width="1.5" stroke-dasharray="5,3"/>"##,
                w = (x2 - x1).max(2.0),
                h = bottom - top,
            );
        }
    }

    /// The key to the symbols, in two rows from `y`: what the bars mean, then the markers.
    fn draw_legend(&mut self, y: f64) {
        let mut out = String::from("<g class=\"legend\">\n");
        let rows: [&[(&str, &str)]; 2] = [
            &[
                ("bar-holder", "holds the lock"),
                ("bar-expired", "lease ran out, holder unaware"),
                ("bar-fault", "fault caused by the lab"),
                ("band-double", "double grant"),
            ],
            &[
                ("grant", "granted"),
                ("lost", "lost signal"),
                ("write-accepted", "write accepted"),
                ("write-refused", "write refused (old token)"),
                ("denied", "tried, not granted"),
                ("server", "server event"),
            ],
        ];
        for (i, items) in rows.iter().enumerate() {
            let y = y + i as f64 * 20.0;
            let mut x = 16.0;
            for (kind, text) in items.iter() {
                let swatch = |fill: &str, stroke: &str| {
                    format!(
                        r##"<rect x="{x:.1}" y="{:.1}" width="22" height="11" rx="2" fill="{fill}" stroke="{stroke}"/>"##,
                        y - 5.5
                    )
                };
                match *kind {
                    "bar-holder" => {
                        let _ = write!(
                            out,
                            r##"<rect x="{x:.1}" y="{:.1}" width="11" height="11" rx="2" fill="{HOLDER}"/><rect x="{:.1}" y="{:.1}" width="11" height="11" rx="2" fill="{RIVAL}"/>"##,
                            y - 5.5,
                            x + 11.0,
                            y - 5.5
                        );
                    }
                    "bar-expired" => out.push_str(&swatch("url(#expired)", HOLDER)),
                    "bar-fault" => out.push_str(&swatch(FAULT, FAULT)),
                    "band-double" => out.push_str(&format!(
                        r##"<rect x="{x:.1}" y="{:.1}" width="22" height="11" fill="{RED}" fill-opacity="0.13" stroke="{RED}" stroke-dasharray="4,2"/>"##,
                        y - 5.5
                    )),
                    _ => out.push_str(&symbol(kind, x + 9.0, y, HOLDER)),
                }
                let _ = write!(
                    out,
                    r##"<text x="{:.1}" y="{:.1}" font-size="{TEXT}" fill="{INK}">{}</text>"##,
                    x + 28.0,
                    y + 4.0,
                    escape(text)
                );
                x += 28.0 + text_width(text) + 12.0;
            }
        }
        out.push_str("</g>\n");
        self.out.push_str(&out);
    }
}

/// A time axis that keeps close events apart: piecewise linear between the moments drawn,
/// each gap at least [`MIN_GAP`] pixels wide and the rest of the width shared in
/// proportion to time. Order is kept exactly; only short gaps are drawn longer.
#[derive(Debug, Clone)]
struct Warp {
    /// (time, x) at each moment drawn, in order.
    knots: Vec<(f64, f64)>,
    /// Whether the gap after each knot is drawn wider than it lasted.
    stretched: Vec<bool>,
    /// The scale of the gaps drawn to scale.
    px_per_second: f64,
}

/// The narrowest gap drawn between two moments, in pixels.
const MIN_GAP: f64 = 26.0;

impl Warp {
    fn new(mut times: Vec<f64>, start: f64, end: f64) -> Warp {
        times.extend([start, end]);
        times.retain(|t| t.is_finite());
        for t in &mut times {
            *t = t.clamp(start, end);
        }
        times.sort_by(f64::total_cmp);
        times.dedup_by(|a, b| (*a - *b).abs() < 1e-4);
        let width = PLOT_RIGHT - PLOT_LEFT;
        let gaps: Vec<f64> = times.windows(2).map(|w| w[1] - w[0]).collect();
        let total: f64 = gaps.iter().sum();
        if gaps.is_empty() || total <= 0.0 {
            let end = end.max(start + 1.0);
            return Warp {
                knots: vec![(start, PLOT_LEFT), (end, PLOT_RIGHT)],
                stretched: vec![false],
                px_per_second: width / (end - start),
            };
        }
        let min = (width * 0.5 / gaps.len() as f64).min(MIN_GAP);
        let drawn = |k: f64| gaps.iter().map(|g| (k * g).max(min)).sum::<f64>();
        // The pixels per second of the gaps drawn to scale.
        let (mut lo, mut hi) = (0.0, width / total);
        for _ in 0..60 {
            let mid = (lo + hi) / 2.0;
            if drawn(mid) < width {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        let scale = width / drawn(hi);
        let mut x = PLOT_LEFT;
        let mut knots = vec![(times[0], x)];
        let mut stretched = Vec::with_capacity(gaps.len());
        for (gap, t) in gaps.iter().zip(&times[1..]) {
            x += (hi * gap).max(min) * scale;
            knots.push((*t, x));
            stretched.push(min > hi * gap * 1.5);
        }
        Warp {
            knots,
            stretched,
            px_per_second: hi * scale,
        }
    }

    /// Where `t` is drawn.
    fn x(&self, t: f64) -> f64 {
        let i = self.knots.partition_point(|(k, _)| *k <= t);
        match (i.checked_sub(1).map(|j| self.knots[j]), self.knots.get(i)) {
            (Some((t0, x0)), Some(&(t1, x1))) if t1 > t0 => x0 + (t - t0) / (t1 - t0) * (x1 - x0),
            (Some((_, x0)), _) => x0,
            (None, _) => PLOT_LEFT,
        }
    }
}

/// Ends the lane's open span at `t`, if one is open.
fn close_span(lane: &mut LaneContent, t: f64) {
    if let Some(span) = lane.spans.last_mut().filter(|s| s.to.is_nan()) {
        span.to = t.max(span.from);
    }
}

/// Puts each label in the first row where it overlaps no other; returns the row count.
fn place(labels: &mut [Placed]) -> usize {
    let mut rows: Vec<Vec<(f64, f64)>> = Vec::new();
    for label in labels.iter_mut() {
        let width = text_width(&label.text) + 8.0;
        label.end_anchored = label.x + width > WIDTH - 8.0;
        let (from, to) = if label.end_anchored {
            (label.x - width, label.x + 4.0)
        } else {
            (label.x - 4.0, label.x + width)
        };
        let row = rows
            .iter()
            .position(|r| r.iter().all(|(a, b)| to <= *a || from >= *b))
            .unwrap_or(rows.len());
        if row == rows.len() {
            rows.push(Vec::new());
        }
        rows[row].push((from, to));
        label.row = row;
    }
    rows.len()
}

/// The time between two ticks: at most about a dozen ticks.
fn tick_step(end: f64) -> f64 {
    [0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0]
        .into_iter()
        .find(|s| end / s <= 12.0)
        .unwrap_or(120.0)
}

/// The symbol of a marker `class`, centred on (`x`, `y`), in the lane's `color`.
fn symbol(class: &str, x: f64, y: f64, color: &str) -> String {
    match class {
        "grant" => format!(
            r##"<path d="M{:.1},{:.1} L{:.1},{:.1} L{:.1},{:.1} Z" fill="{color}" stroke="{INK}" stroke-width="0.8"/>"##,
            x - 1.0,
            y - 8.0,
            x + 10.0,
            y,
            x - 1.0,
            y + 8.0
        ),
        "renewed" => format!(
            r##"<rect x="{:.1}" y="{:.1}" width="3" height="16" fill="{color}" stroke="{INK}" stroke-width="0.6"/>"##,
            x - 1.5,
            y - 8.0
        ),
        "renew-failed" => format!(
            r##"<rect x="{:.1}" y="{:.1}" width="3" height="16" fill="{RED}"/>"##,
            x - 1.5,
            y - 8.0
        ),
        "lease-end" => format!(
            r##"<line x1="{x:.1}" y1="{:.1}" x2="{x:.1}" y2="{:.1}" stroke="{INK}" stroke-width="1.5" stroke-dasharray="3,2"/>"##,
            y - 11.0,
            y + 11.0
        ),
        "lost" => format!(
            r##"<path d="M{x:.1},{:.1} L{:.1},{y:.1} L{x:.1},{:.1} L{:.1},{y:.1} Z" fill="{FAULT}" stroke="{INK}" stroke-width="0.8"/><text x="{x:.1}" y="{:.1}" font-size="10" font-weight="bold" fill="#ffffff" text-anchor="middle">!</text>"##,
            y - 8.0,
            x + 8.0,
            y + 8.0,
            x - 8.0,
            y + 3.5
        ),
        "released" => format!(
            r##"<rect x="{:.1}" y="{:.1}" width="10" height="10" fill="#ffffff" stroke="{color}" stroke-width="2"/>"##,
            x - 5.0,
            y - 5.0
        ),
        "denied" => format!(
            r##"<circle cx="{x:.1}" cy="{y:.1}" r="5.5" fill="#ffffff" stroke="{MUTED}" stroke-width="1.5"/><line x1="{:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="{MUTED}" stroke-width="1.5"/>"##,
            x - 4.0,
            y + 4.0,
            x + 4.0,
            y - 4.0
        ),
        "write-accepted" => format!(
            r##"<circle cx="{x:.1}" cy="{y:.1}" r="7" fill="{GREEN}" stroke="#ffffff" stroke-width="1"/><path d="M{:.1},{:.1} L{:.1},{:.1} L{:.1},{:.1}" fill="none" stroke="#ffffff" stroke-width="2"/>"##,
            x - 3.5,
            y,
            x - 1.0,
            y + 3.0,
            x + 4.0,
            y - 3.0
        ),
        "write-refused" | "write-stale-accepted" => {
            let fill = if class == "write-refused" {
                RED
            } else {
                "#862e9c"
            };
            format!(
                r##"<circle cx="{x:.1}" cy="{y:.1}" r="7" fill="{fill}" stroke="#ffffff" stroke-width="1"/><path d="M{:.1},{:.1} L{:.1},{:.1} M{:.1},{:.1} L{:.1},{:.1}" stroke="#ffffff" stroke-width="2"/>"##,
                x - 3.0,
                y - 3.0,
                x + 3.0,
                y + 3.0,
                x - 3.0,
                y + 3.0,
                x + 3.0,
                y - 3.0
            )
        }
        _ => format!(r##"<circle cx="{x:.1}" cy="{y:.1}" r="4" fill="{MUTED}"/>"##),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::report::{Expect, Observed};

    fn at(ms: u64, mark: Mark, text: &str) -> Event {
        Event::new(Duration::from_millis(ms), mark, text)
    }

    fn granted(who: Actor, token: u64) -> Mark {
        Mark::Granted { who, token }
    }

    fn write(who: Actor, token: u64, outcome: WriteOutcome) -> Mark {
        Mark::Write {
            who,
            token,
            outcome,
        }
    }

    fn report(
        scenario: &'static str,
        backend: &'static str,
        seen: (bool, LostSignal, Stale),
        timeline: Vec<Event>,
    ) -> Report {
        let expect = Expect {
            double_grant: seen.0,
            lost: seen.1,
            stale: seen.2,
        };
        Report {
            scenario,
            backend,
            consistency: Some(Consistency::Ap),
            expect,
            observed: Some(Observed {
                double_grant: seen.0,
                lost: seen.1,
                stale: seen.2,
                violations: Vec::new(),
            }),
            timeline,
            problems: Vec::new(),
            elapsed: Duration::from_secs(3),
        }
    }

    /// A holder frozen past its lease, as a real run of `holder-paused` on `redis` recorded
    /// it: everything after the pause happens within 30 ms.
    fn paused() -> Report {
        use Actor::*;
        let (old, new) = (1_795_590_695_354_545, 1_795_590_698_024_644);
        report(
            "holder-paused",
            "redis",
            (false, LostSignal::AfterRival, Stale::Refused),
            vec![
                at(
                    206,
                    Mark::Note,
                    "fenced store: `r` through lockkit::fence::RedisFence",
                ),
                at(211, granted(Holder, old), "holder granted"),
                at(
                    1264,
                    Mark::FaultBegins {
                        id: 0,
                        label: "holder frozen (SIGSTOP)".into(),
                    },
                    "holder SIGSTOPped",
                ),
                at(
                    2856,
                    Mark::LeaseEnds { who: Holder },
                    "the lease deadline passes",
                ),
                at(2881, granted(Rival, new), "rival granted"),
                at(
                    2882,
                    write(Rival, new, WriteOutcome::Accepted),
                    "rival writes",
                ),
                at(
                    2882,
                    Mark::FaultEnds {
                        id: 0,
                        label: "resumed (SIGCONT)".into(),
                    },
                    "holder SIGCONTed",
                ),
                at(
                    2883,
                    Mark::Lost { who: Holder },
                    "holder's guard fired lost on resume",
                ),
                at(
                    2883,
                    write(Holder, old, WriteOutcome::Refused),
                    "holder's write: refused",
                ),
                at(2884, Mark::Released { who: Rival }, "rival released"),
            ],
        )
    }

    /// Redis restarted empty mid-hold, as `server-restarted` on `redis` records it.
    fn restarted() -> Report {
        use Actor::*;
        report(
            "server-restarted",
            "redis",
            (true, LostSignal::AfterRival, Stale::Refused),
            vec![
                at(300, granted(Holder, 7), "holder granted token 7"),
                at(
                    310,
                    write(Holder, 7, WriteOutcome::Accepted),
                    "holder writes",
                ),
                at(
                    400,
                    Mark::FaultBegins {
                        id: 0,
                        label: "Redis killed (SIGKILL)".into(),
                    },
                    "Redis SIGKILLed",
                ),
                at(
                    900,
                    Mark::FaultEnds {
                        id: 0,
                        label: "restarted, empty".into(),
                    },
                    "Redis restarted, empty",
                ),
                at(1000, granted(Rival, 9), "rival granted token 9"),
                at(
                    1010,
                    write(Rival, 9, WriteOutcome::Accepted),
                    "rival writes",
                ),
                at(
                    1050,
                    Mark::RenewFailed { who: Holder },
                    "holder renews its lease: lost",
                ),
                at(
                    1051,
                    Mark::Lost { who: Holder },
                    "holder's guard fired lost",
                ),
                at(
                    1060,
                    write(Holder, 7, WriteOutcome::Refused),
                    "holder writes: refused",
                ),
                at(1100, Mark::Released { who: Rival }, "rival released"),
            ],
        )
    }

    /// A leader frozen and the lock kept, as `server-paused` on `zk-ensemble` records it.
    fn kept() -> Report {
        use Actor::*;
        report(
            "server-paused",
            "zk-ensemble",
            (false, LostSignal::Never, Stale::NoStaleHolder),
            vec![
                at(500, granted(Holder, 3), "holder granted token 3"),
                at(
                    510,
                    write(Holder, 3, WriteOutcome::Accepted),
                    "holder writes",
                ),
                at(
                    600,
                    Mark::FaultBegins {
                        id: 0,
                        label: "leader frozen (SIGSTOP)".into(),
                    },
                    "leader SIGSTOPped",
                ),
                at(
                    8600,
                    Mark::Denied {
                        who: Rival,
                        label: "no answer".into(),
                    },
                    "rival got no answer",
                ),
                at(
                    8600,
                    Mark::FaultEnds {
                        id: 0,
                        label: "resumed (SIGCONT)".into(),
                    },
                    "leader SIGCONTed",
                ),
                at(
                    9500,
                    Mark::Server {
                        label: "ensemble settled".into(),
                    },
                    "ensemble settled",
                ),
                at(
                    9600,
                    Mark::Denied {
                        who: Rival,
                        label: "busy".into(),
                    },
                    "rival tries: busy",
                ),
                at(9700, Mark::Renewed { who: Holder }, "holder renews"),
                at(
                    9710,
                    write(Holder, 3, WriteOutcome::Accepted),
                    "holder writes",
                ),
                at(9800, Mark::Released { who: Holder }, "holder released"),
                at(9900, granted(Rival, 4), "rival granted token 4"),
                at(10000, Mark::Released { who: Rival }, "rival released"),
            ],
        )
    }

    /// The elements whose class list has `class`, with their `data-actor` and `data-t`.
    fn find_class<'a>(doc: &'a roxmltree::Document<'a>, class: &str) -> Vec<(String, f64)> {
        doc.descendants()
            .filter(|n| {
                n.attribute("class")
                    .is_some_and(|c| c.split_whitespace().any(|w| w == class))
            })
            .map(|n| {
                (
                    n.attribute("data-actor").unwrap_or("").to_owned(),
                    n.attribute("data-t")
                        .and_then(|t| t.parse().ok())
                        .unwrap_or(f64::NAN),
                )
            })
            .collect()
    }

    #[test]
    fn a_paused_holder_shows_its_expired_lease_the_rivals_grant_and_the_refused_write() {
        let report = paused();
        let text = render(&report);
        let doc = roxmltree::Document::parse(&text).expect("the picture is XML");
        let root = doc.root_element();
        assert_eq!(root.tag_name().name(), "svg");
        assert_eq!(root.attribute("width"), Some("800"));
        assert_eq!(root.attribute("data-lost"), Some("after-rival"));
        assert_eq!(root.attribute("data-stale"), Some("refused"));
        assert_eq!(find_class(&doc, "fault").len(), 1);
        assert_eq!(
            find_class(&doc, "lease").len(),
            3,
            "two spans, one expired part"
        );
        assert_eq!(find_class(&doc, "expired").len(), 1);
        let grants = find_class(&doc, "grant");
        assert_eq!(grants.len(), 2);
        let refused = find_class(&doc, "write-refused");
        assert_eq!(refused, vec![("holder".to_owned(), 2.883)]);
        assert_eq!(
            find_class(&doc, "write-accepted"),
            vec![("rival".to_owned(), 2.882)]
        );
        let lost = find_class(&doc, "lost");
        let rival_grant = grants.iter().find(|g| g.0 == "rival").map(|g| g.1);
        assert!(lost.len() == 1 && Some(lost[0].1) > rival_grant, "{lost:?}");
        assert!(find_class(&doc, "double-grant").is_empty());
        assert!(text.contains("granted, token 1795590695354545"));
        assert!(text.contains("write with its old token REFUSED"));
        let caption = caption(&report);
        assert!(
            caption.contains("only after the holder's lease had run out"),
            "{caption}"
        );
        assert!(caption.contains("refused by RedisFence"), "{caption}");
        assert!(text.contains(&escape(&caption)) || wrap(&caption, 106).len() > 1);
    }

    #[test]
    fn a_double_grant_is_drawn_where_both_spans_overlap() {
        let text = render(&restarted());
        let doc = roxmltree::Document::parse(&text).expect("the picture is XML");
        let band = doc
            .descendants()
            .find(|n| n.attribute("class") == Some("double-grant"))
            .expect("a double-grant band");
        assert_eq!(band.attribute("data-t"), Some("1.000"));
        assert_eq!(band.attribute("data-until"), Some("1.051"));
        assert_eq!(find_class(&doc, "renew-failed").len(), 1);
        assert!(caption(&restarted()).contains("double grant, the hazard this scenario shows"));
    }

    #[test]
    fn a_kept_lock_has_no_loss_no_refused_write_and_the_rivals_tries() {
        let report = kept();
        let text = render(&report);
        let doc = roxmltree::Document::parse(&text).expect("the picture is XML");
        assert!(find_class(&doc, "lost").is_empty());
        assert!(find_class(&doc, "write-refused").is_empty());
        assert!(find_class(&doc, "double-grant").is_empty());
        assert_eq!(find_class(&doc, "denied").len(), 2);
        assert_eq!(
            find_class(&doc, "server").len(),
            2,
            "the resume and the settling"
        );
        assert_eq!(find_class(&doc, "released").len(), 2);
        let caption = caption(&report);
        assert!(caption.contains("kept the lock"), "{caption}");
        assert!(!caption.contains("write"), "{caption}");
    }

    #[test]
    fn text_is_escaped_and_a_failed_run_says_so() {
        let mut report = kept();
        report.timeline.push(at(
            10_100,
            Mark::Server {
                label: "a <b> & \"c\" 'd'".into(),
            },
            "x < y && \u{1} z",
        ));
        report.problems.push("lost signal: expected `no`".into());
        let text = render(&report);
        let doc = roxmltree::Document::parse(&text).expect("escaped text stays XML");
        assert!(
            doc.descendants()
                .any(|n| n.text() == Some("a <b> & \"c\" 'd'")),
            "the label reads back as written"
        );
        assert!(caption(&report).starts_with("FAILED"));
        report.observed = None;
        assert!(caption(&report).contains("stopped before it could be judged"));
        let doc_text = render(&report);
        roxmltree::Document::parse(&doc_text).expect("an unjudged run still draws");
    }

    #[test]
    fn an_empty_timeline_still_draws_an_axis() {
        let mut report = kept();
        report.timeline.clear();
        let text = render(&report);
        let doc = roxmltree::Document::parse(&text).expect("the picture is XML");
        assert!(doc.descendants().any(|n| n.text() == Some("0.5 s")));
    }

    #[test]
    fn helpers() {
        assert_eq!(wrap("aa bb cc", 5), vec!["aa bb", "cc"]);
        assert_eq!(wrap("", 5), Vec::<String>::new());
        assert_eq!(tick_step(3.0), 0.5);
        assert_eq!(tick_step(11.0), 1.0);
        assert_eq!(tick_step(40.0), 5.0);
        assert_eq!(escape("<a&'\">"), "&lt;a&amp;&apos;&quot;&gt;");
        assert_eq!(file_name("failover", "redis"), "failover-redis.svg");
    }

    /// Writes the sample pictures where `LOCKKIT_LAB_SVG_SAMPLES` says, to look at them.
    #[test]
    fn samples() {
        if let Some(dir) = std::env::var_os("LOCKKIT_LAB_SVG_SAMPLES") {
            let dir = std::path::PathBuf::from(dir);
            for r in [paused(), restarted(), kept()] {
                std::fs::write(dir.join(file_name(r.scenario, r.backend)), render(&r)).unwrap();
            }
        }
    }
}
