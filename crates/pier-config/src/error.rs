//! Config errors: every problem found in one pass, each as
//! `FILE:LINE:COL: message` (or `FILE: message` when there is no position).

use std::fmt;
use std::ops::Range;

use crate::env::SourceMap;

/// 1-based line and column (the column counts characters, not bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    pub line: u32,
    pub col: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The file name (or other source label) given to the loader.
    pub file: String,
    pub location: Option<Location>,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.location {
            Some(l) => write!(f, "{}:{}:{}: {}", self.file, l.line, l.col, self.message),
            None => write!(f, "{}: {}", self.file, self.message),
        }
    }
}

impl std::error::Error for ConfigError {}

/// All errors found in one config; never empty when returned as an `Err`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl ConfigErrors {
    pub fn iter(&self) -> std::slice::Iter<'_, ConfigError> {
        self.0.iter()
    }
    pub fn len(&self) -> usize {
        self.0.len()
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl<'a> IntoIterator for &'a ConfigErrors {
    type Item = &'a ConfigError;
    type IntoIter = std::slice::Iter<'a, ConfigError>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.iter()
    }
}

/// One line per error, in file order.
impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

/// An error found while checking the file, located by a byte span of the
/// *expanded* text (spans from toml point there).
#[derive(Debug, Clone)]
pub(crate) struct RawError {
    pub span: Option<Range<usize>>,
    pub message: String,
}

impl RawError {
    pub fn at(span: Option<Range<usize>>, message: impl Into<String>) -> RawError {
        RawError {
            span,
            message: message.into(),
        }
    }
}

/// Turns byte offsets of the original text into line/column.
pub(crate) struct Locator<'a> {
    pub file: &'a str,
    pub original: &'a str,
    pub map: &'a SourceMap,
}

impl Locator<'_> {
    pub fn location_of_original(&self, offset: usize) -> Location {
        let offset = offset.min(self.original.len());
        // Back off to a char boundary so slicing cannot panic.
        let mut o = offset;
        while !self.original.is_char_boundary(o) {
            o -= 1;
        }
        let before = &self.original[..o];
        let line_start = before.rfind('\n').map_or(0, |p| p + 1);
        Location {
            line: before.bytes().filter(|&b| b == b'\n').count() as u32 + 1,
            col: before[line_start..].chars().count() as u32 + 1,
        }
    }

    pub fn error(&self, raw: RawError) -> ConfigError {
        ConfigError {
            file: self.file.to_string(),
            location: raw
                .span
                .map(|s| self.location_of_original(self.map.original(s.start))),
            message: raw.message,
        }
    }
}
