//! Secrets (the republish password, the admin API's tokens, a broker URI
//! with a password in it): each is given inline (`password`), or by the
//! name of an environment variable holding it (`password_env`), or by the
//! path of a file holding it (`password_file`, as Kubernetes and Docker
//! mount secrets), never two ways at once.
//!
//! A variable or a file is read where the secret is used: at startup and
//! by `nackd --check-config`. A file's trailing newline is not part of the
//! secret (`echo secret > file` writes one).

use std::path::PathBuf;

/// The three ways of giving one secret, as the file sets them.
#[derive(Clone, Copy, Debug)]
pub struct Secret<'a> {
    /// Dotted key of the inline value (`republish.password`); the other
    /// two keys are it with `_env` and `_file`.
    pub key: &'a str,
    /// The value itself.
    pub inline: &'a Option<String>,
    /// The environment variable holding it.
    pub env: &'a Option<String>,
    /// The file holding it.
    pub file: &'a Option<PathBuf>,
}

impl Secret<'_> {
    /// The keys set, of `key`, `key_env`, `key_file`.
    fn keys_set(&self) -> Vec<String> {
        [
            (self.inline.is_some(), ""),
            (self.env.is_some(), "_env"),
            (self.file.is_some(), "_file"),
        ]
        .into_iter()
        .filter(|(set, _)| *set)
        .map(|(_, suffix)| format!("{}{suffix}", self.key))
        .collect()
    }

    /// Whether one way at most is set; an error names the two keys set
    /// (under the second).
    pub fn check(&self) -> Result<(), (String, String)> {
        match self.keys_set().as_slice() {
            [first, second, ..] => {
                Err((second.clone(), format!("set {first} or {second}, not both")))
            }
            _ => Ok(()),
        }
    }

    /// The key it is set under, if it is.
    pub fn key_set(&self) -> Option<String> {
        self.keys_set().into_iter().next()
    }

    /// The secret and the key it came from, read from the variable or the
    /// file; `None` when it is not set. An error starts with the key and
    /// names the variable or the path.
    pub fn read(&self) -> Result<Option<(String, String)>, String> {
        if let Some(value) = self.inline {
            return Ok(Some((value.clone(), self.key.to_string())));
        }
        if let Some(var) = self.env {
            let key = format!("{}_env", self.key);
            let value = std::env::var(var).map_err(|_| format!("{key}: {var} is not set"))?;
            return Ok(Some((value, key)));
        }
        let Some(path) = self.file else {
            return Ok(None);
        };
        let key = format!("{}_file", self.key);
        let text = read_secret_file(path).map_err(|e| format!("{key}: {e}"))?;
        let value = text.trim_end_matches(['\n', '\r']);
        if value.is_empty() {
            return Err(format!("{key}: {} is empty", path.display()));
        }
        Ok(Some((value.to_string(), key)))
    }
}

/// The most a secret file may hold: a password, a token or a URI is far
/// shorter, and more means the key names the wrong file.
const MAX_SECRET_FILE: u64 = 64 * 1024;

/// A secret file's text: a regular file (symbolic links followed, as
/// Kubernetes mounts secrets through them) of at most [`MAX_SECRET_FILE`]
/// bytes, so that a FIFO cannot hang startup and `/dev/zero` cannot fill
/// the memory. The error names the path.
fn read_secret_file(path: &std::path::Path) -> Result<String, String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    // O_NONBLOCK: opening a FIFO for reading would wait for a writer.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let meta = file
        .metadata()
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    if !meta.is_file() {
        return Err(format!("{} is not a regular file", path.display()));
    }
    let mut text = String::new();
    file.take(MAX_SECRET_FILE + 1)
        .read_to_string(&mut text)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    if text.len() as u64 > MAX_SECRET_FILE {
        return Err(format!(
            "{} is larger than {MAX_SECRET_FILE} bytes: not a secret",
            path.display()
        ));
    }
    Ok(text)
}
