//! The one error type of the Lua layer.

use std::fmt;

use crate::phase::Phase;

/// A failed hook (or state setup). The proxy answers 500 and logs it;
/// `message` carries the Lua chunk name and line (`route api access:3: ...`).
#[derive(Debug, Clone)]
pub struct LuaError {
    /// The phase that failed, if a hook did.
    pub phase: Option<Phase>,
    pub message: String,
}

impl LuaError {
    pub(crate) fn new(phase: Option<Phase>, message: impl Into<String>) -> Self {
        LuaError {
            phase,
            message: message.into(),
        }
    }

    pub(crate) fn lua(phase: Option<Phase>, e: mlua::Error) -> Self {
        LuaError::new(phase, describe(&e))
    }
}

/// The message of a Lua error, without mlua's wrapping noise, followed by
/// the traceback when there is one.
pub(crate) fn describe(e: &mlua::Error) -> String {
    match e {
        mlua::Error::RuntimeError(m) | mlua::Error::SyntaxError { message: m, .. } => m.clone(),
        mlua::Error::CallbackError { traceback, cause } => {
            format!("{}\n{traceback}", describe(cause))
        }
        mlua::Error::WithContext { context, cause } => format!("{context}: {}", describe(cause)),
        other => other.to_string(),
    }
}

impl fmt::Display for LuaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.phase {
            Some(p) => write!(f, "lua {p} hook failed: {}", self.message),
            None => write!(f, "lua: {}", self.message),
        }
    }
}

impl std::error::Error for LuaError {}
