//! Hugging Face chat templates on minijinja, made to render what `transformers` renders.
//!
//! `transformers.apply_chat_template` renders with a Jinja2 sandbox built with
//! `trim_blocks=True, lstrip_blocks=True` and the `loopcontrols` extension, a `tojson` filter
//! that is Python's `json.dumps` (no HTML escaping, `ensure_ascii=False`, `", "`/`": "`
//! separators), and the globals `raise_exception(msg)` and `strftime_now(fmt)`. This module
//! sets up one [`Environment`] the same way; Python string and dict methods (`.strip()`,
//! `.startswith()`, `.items()` …) come from `minijinja_contrib::pycompat`, and `None`, `True`
//! and `False` print as Python prints them.
//!
//! Known differences from Jinja2, all rare in real chat templates: the `{% generation %}`
//! block of transformers' `AssistantTracker` is not supported (such a template fails to
//! compile, with a clear error); `strftime_now` formats the current time in UTC (Python uses
//! the server's local time zone, which for vLLM in a container is almost always UTC); floats
//! printed with `{{ }}` use Rust's formatting.

use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{AutoEscape, Environment, Error, ErrorKind, Output, State, Value};

/// An [`Environment`] configured like transformers' chat-template sandbox, with no template.
pub(crate) fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_keep_trailing_newline(false);
    env.set_auto_escape_callback(|_| AutoEscape::None);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.set_formatter(python_formatter);
    env.add_filter("tojson", tojson);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env
}

/// Prints `none`, `true` and `false` the way Python's `str()` does; everything else as
/// minijinja does (undefined prints nothing, as in Jinja2).
fn python_formatter(out: &mut Output, state: &State, value: &Value) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None => out.write_str("None").map_err(Error::from),
        ValueKind::Bool => {
            let text = if value.is_true() { "True" } else { "False" };
            out.write_str(text).map_err(Error::from)
        }
        _ => minijinja::escape_formatter(out, state, value),
    }
}

/// `raise_exception(message)`: the template refuses the conversation.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now(format)`: the current UTC time formatted with a subset of C's `strftime`.
fn strftime_now(format: String) -> Result<Value, Error> {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    Ok(Value::from(strftime_utc(
        i64::try_from(secs).unwrap_or(0),
        &format,
    )))
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// Formats `unix_secs` (UTC) with `%Y %y %m %d %e %j %H %I %M %S %p %b %h %B %a %A %%`; a `-`
/// after `%` drops zero padding (glibc). Unknown directives are copied through, as glibc does.
pub(crate) fn strftime_utc(unix_secs: i64, format: &str) -> String {
    let days = unix_secs.div_euclid(86_400);
    let secs_of_day = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let hour = secs_of_day / 3600;
    let minute = secs_of_day % 3600 / 60;
    let second = secs_of_day % 60;
    // 1970-01-01 was a Thursday (index 3 with Monday = 0).
    let weekday = usize::try_from((days + 3).rem_euclid(7)).unwrap_or(0);
    let month_idx = usize::try_from(month - 1).unwrap_or(0);
    let day_of_year = days - days_from_civil(year, 1, 1) + 1;
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };

    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let unpadded = chars.peek() == Some(&'-');
        if unpadded {
            chars.next();
        }
        let num = |out: &mut String, v: i64, width: usize| {
            if unpadded {
                let _ = write!(out, "{v}");
            } else {
                let _ = write!(out, "{v:0width$}");
            }
        };
        match chars.next() {
            Some('Y') => {
                let _ = write!(out, "{year}");
            }
            Some('y') => num(&mut out, year.rem_euclid(100), 2),
            Some('m') => num(&mut out, month, 2),
            Some('d') => num(&mut out, day, 2),
            Some('e') => {
                if unpadded {
                    let _ = write!(out, "{day}");
                } else {
                    let _ = write!(out, "{day:2}");
                }
            }
            Some('j') => num(&mut out, day_of_year, 3),
            Some('H') => num(&mut out, hour, 2),
            Some('I') => num(&mut out, hour12, 2),
            Some('M') => num(&mut out, minute, 2),
            Some('S') => num(&mut out, second, 2),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('b') | Some('h') => out.push_str(&MONTHS[month_idx][..3]),
            Some('B') => out.push_str(MONTHS[month_idx]),
            Some('a') => out.push_str(&WEEKDAYS[weekday][..3]),
            Some('A') => out.push_str(WEEKDAYS[weekday]),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                if unpadded {
                    out.push('-');
                }
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Days since 1970-01-01 to (year, month 1-12, day 1-31), proleptic Gregorian.
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// (year, month, day) to days since 1970-01-01.
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if month > 2 { month - 3 } else { month + 9 };
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`, all four keyword arguments honoured (`indent` also positionally).
fn tojson(value: &Value, indent: Option<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let indent = match indent {
        Some(v) => Some(v),
        None => kwargs.get::<Option<Value>>("indent")?,
    };
    let indent: Option<String> = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => match v.kind() {
            ValueKind::Number => {
                let n = i64::try_from(v)?;
                Some(" ".repeat(usize::try_from(n.max(0)).unwrap_or(0)))
            }
            ValueKind::String => Some(v.as_str().unwrap_or_default().to_owned()),
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be an integer or a string",
                ));
            }
        },
    };
    let ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    let separators = kwargs.get::<Option<Value>>("separators")?;
    let (item_sep, key_sep) = match separators {
        Some(v) if !v.is_none() && !v.is_undefined() => {
            let item = v.get_item(&Value::from(0))?;
            let key = v.get_item(&Value::from(1))?;
            match (item.as_str(), key.as_str()) {
                (Some(i), Some(k)) => (i.to_owned(), k.to_owned()),
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be a pair of strings",
                    ));
                }
            }
        }
        _ if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        _ => (", ".to_owned(), ": ".to_owned()),
    };
    kwargs.assert_all_used()?;
    let opts = JsonOpts {
        indent,
        item_sep,
        key_sep,
        ensure_ascii,
        sort_keys,
    };
    let mut out = String::new();
    write_json(&mut out, value, &opts, 0)?;
    Ok(Value::from(out))
}

struct JsonOpts {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    ensure_ascii: bool,
    sort_keys: bool,
}

impl JsonOpts {
    fn newline(&self, out: &mut String, depth: usize) {
        if let Some(indent) = &self.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(indent);
            }
        }
    }
}

fn write_json(out: &mut String, value: &Value, opts: &JsonOpts, depth: usize) -> Result<(), Error> {
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => write_number(out, value),
        ValueKind::String | ValueKind::Bytes => {
            write_json_str(out, value.as_str().unwrap_or_default(), opts.ensure_ascii);
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                opts.newline(out, depth + 1);
                write_json(out, item, opts, depth + 1)?;
            }
            opts.newline(out, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if opts.sort_keys {
                keys.sort();
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                opts.newline(out, depth + 1);
                let item = value.get_item(key)?;
                match key.kind() {
                    ValueKind::String => {
                        write_json_str(out, key.as_str().unwrap_or_default(), opts.ensure_ascii);
                    }
                    ValueKind::None => out.push_str("\"null\""),
                    ValueKind::Bool | ValueKind::Number => {
                        let mut k = String::new();
                        write_json(&mut k, key, opts, depth)?;
                        write_json_str(out, &k, opts.ensure_ascii);
                    }
                    _ => {
                        return Err(Error::new(
                            ErrorKind::InvalidOperation,
                            "tojson: keys must be str, int, float, bool or None",
                        ));
                    }
                }
                out.push_str(&opts.key_sep);
                write_json(out, &item, opts, depth + 1)?;
            }
            opts.newline(out, depth);
            out.push('}');
        }
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: cannot serialize a value of kind {}", value.kind()),
            ));
        }
    }
    Ok(())
}

/// Numbers as Python's `json.dumps` writes them: integers plainly, floats with `repr`
/// (`1.0`, `1e+20`, `1.5e-05`, `NaN`, `Infinity`).
fn write_number(out: &mut String, value: &Value) {
    if value.is_integer() {
        // Integers (including 128-bit ones) print exactly as minijinja prints them.
        let _ = write!(out, "{value}");
        return;
    }
    let f = f64::try_from(value.clone()).unwrap_or(f64::NAN);
    out.push_str(&python_float_repr(f));
}

/// Python's `repr(float)`: shortest round-trip digits, scientific below 1e-4 and from 1e16.
pub(crate) fn python_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".to_owned();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.to_owned();
    }
    let abs = f.abs();
    if abs != 0.0 && !(1e-4..1e16).contains(&abs) {
        // Rust: "1e20", "1.5e-5"; Python: "1e+20", "1.5e-05".
        let s = format!("{f:e}");
        if let Some((mantissa, exp)) = s.split_once('e') {
            let (sign, digits) = match exp.strip_prefix('-') {
                Some(d) => ('-', d),
                None => ('+', exp),
            };
            return format!("{mantissa}e{sign}{digits:0>2}");
        }
        return s;
    }
    let s = format!("{f}");
    if s.contains('.') { s } else { format!("{s}.0") }
}

fn write_json_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && !c.is_ascii() => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(src: &str, ctx: Value) -> String {
        let mut env = environment();
        env.add_template_owned("t", src.to_owned()).unwrap();
        env.get_template("t").unwrap().render(ctx).unwrap()
    }

    #[test]
    fn strftime_matches_known_dates() {
        // 2024-07-26 00:00:00 UTC, a Friday.
        assert_eq!(strftime_utc(1_721_952_000, "%d %b %Y"), "26 Jul 2024");
        assert_eq!(
            strftime_utc(
                1_721_952_000 + 13 * 3600 + 5 * 60 + 9,
                "%A %B %-d, %y %H:%M:%S %I%p %j"
            ),
            "Friday July 26, 24 13:05:09 01PM 208"
        );
        assert_eq!(
            strftime_utc(0, "%Y-%m-%d %a %e %% %Q"),
            "1970-01-01 Thu  1 % %Q"
        );
        assert_eq!(strftime_utc(951_782_400, "%Y-%m-%d"), "2000-02-29");
    }

    #[test]
    fn tojson_is_python_json_dumps() {
        let v = Value::from_serialize(serde_json::json!({
            "a": {},
            "b": [1, 2.5, true, null, "x<y>&'\"\n"],
            "ü": [],
        }));
        let out = render("{{ v | tojson }}", minijinja::context! { v => v.clone() });
        // Keys in the map's own order (written sorted so either serde_json map order agrees).
        assert_eq!(
            out,
            r#"{"a": {}, "b": [1, 2.5, true, null, "x<y>&'\"\n"], "ü": []}"#
        );
        let out = render(
            "{{ v | tojson(indent=2) }}",
            minijinja::context! { v => v.clone() },
        );
        assert_eq!(
            out,
            "{\n  \"a\": {},\n  \"b\": [\n    1,\n    2.5,\n    true,\n    null,\n    \"x<y>&'\\\"\\n\"\n  ],\n  \"ü\": []\n}"
        );
        let out = render(
            "{{ v | tojson(ensure_ascii=true, separators=(',', ':'), sort_keys=true) }}",
            minijinja::context! { v => v },
        );
        assert_eq!(
            out,
            r#"{"a":{},"b":[1,2.5,true,null,"x<y>&'\"\n"],"\u00fc":[]}"#
        );
    }

    #[test]
    fn python_floats() {
        assert_eq!(python_float_repr(1.0), "1.0");
        assert_eq!(python_float_repr(0.1), "0.1");
        assert_eq!(python_float_repr(1e20), "1e+20");
        assert_eq!(python_float_repr(1.5e-5), "1.5e-05");
        assert_eq!(python_float_repr(-0.0), "-0.0");
    }

    #[test]
    fn python_printing_and_methods() {
        let out = render(
            "{{ none }} {{ true }} {{ '  a b '.strip() }} {{ 'abc'.startswith('ab') }} {{ x }}|",
            minijinja::context! {},
        );
        assert_eq!(out, "None True a b True |");
    }

    #[test]
    fn raise_exception_is_an_error() {
        let mut env = environment();
        env.add_template_owned("t", "{{ raise_exception('no system role') }}".to_owned())
            .unwrap();
        let err = env
            .get_template("t")
            .unwrap()
            .render(minijinja::context! {})
            .unwrap_err();
        assert!(err.to_string().contains("no system role"), "{err}");
    }
}
