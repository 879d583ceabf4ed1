//! `--cudnn-version` (`upipe plan`, `[plan] cudnn-version`): the cuDNN
//! version a plan assumes, written `9.19`, `9.19.0` or as cuDNN numbers it
//! (`91900`).

use crate::backend::cuda::cudnn::select::version_text;
use crate::error::{Error, Result};
use std::fmt;
use std::str::FromStr;

/// The cuDNN a plan assumes when no cuDNN is loaded (`upipe plan` on a
/// machine without one, unless `--cudnn-version` names another): the one on
/// our H200 machine (9.14; its backward needs `s_kv % 128 == 0`, newer ones
/// take more shapes). A run plans the version it loaded.
pub const PLANNED_CUDNN_VERSION: usize = 91400;

/// A cuDNN version as cuDNN numbers it (`cudnnGetVersion`: 91900 is 9.19.0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudnnVersion(pub usize);

/// The oldest cuDNN upipe uses (its SDPA graphs need 9.0).
const OLDEST: usize = 90000;

impl FromStr for CudnnVersion {
    type Err = Error;
    fn from_str(s: &str) -> Result<CudnnVersion> {
        let bad = || {
            Error::Config(format!(
                "--cudnn-version {s:?}: give a cuDNN version as 9.19, 9.19.0 or 91900"
            ))
        };
        let number = |t: &str, below: usize| {
            t.parse::<usize>()
                .ok()
                .filter(|&n| n < below && !t.starts_with('+'))
                .ok_or_else(bad)
        };
        let parts: Vec<&str> = s.trim().split('.').collect();
        let version = match parts[..] {
            // cuDNN's own number: major·10000 + minor·100 + patch
            [whole] if whole.len() >= 5 => number(whole, 100 * 10000)?,
            [major, minor] => number(major, 100)? * 10000 + number(minor, 100)? * 100,
            [major, minor, patch] => {
                number(major, 100)? * 10000 + number(minor, 100)? * 100 + number(patch, 100)?
            }
            _ => return Err(bad()),
        };
        if version < OLDEST {
            return crate::config_err!(
                "--cudnn-version {s}: cuDNN {} is older than 9.0, which upipe needs for \
                 cuDNN attention; give 9.0 or newer, or plan --attn-kernel native",
                version_text(version)
            );
        }
        Ok(CudnnVersion(version))
    }
}

impl fmt::Display for CudnnVersion {
    /// `9.19.0`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&version_text(self.0))
    }
}

impl serde::Serialize for CudnnVersion {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> serde::Deserialize<'de> for CudnnVersion {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        d.deserialize_any(VersionVisitor)
    }
}

/// Reads `"9.19"`, `"9.19.0"` or `91900`; a TOML float is refused (9.1 and
/// 9.10 are the same float).
struct VersionVisitor;

impl serde::de::Visitor<'_> for VersionVisitor {
    type Value = CudnnVersion;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a cuDNN version as a string (\"9.19\") or cuDNN's number (91900)")
    }
    fn visit_str<E: serde::de::Error>(self, v: &str) -> std::result::Result<CudnnVersion, E> {
        v.parse().map_err(|e: Error| E::custom(e.to_string()))
    }
    fn visit_u64<E: serde::de::Error>(self, v: u64) -> std::result::Result<CudnnVersion, E> {
        self.visit_str(&v.to_string())
    }
    fn visit_i64<E: serde::de::Error>(self, v: i64) -> std::result::Result<CudnnVersion, E> {
        self.visit_str(&v.to_string())
    }
    fn visit_f64<E: serde::de::Error>(self, v: f64) -> std::result::Result<CudnnVersion, E> {
        Err(E::custom(format!(
            "the cuDNN version {v} is a number, which cannot tell 9.1 from 9.10: \
             quote it (\"9.19\") or give cuDNN's number (91900)"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_parse_as_cudnn_writes_them() {
        for (text, want) in [
            ("9.19", 91900),
            ("9.19.0", 91900),
            ("91900", 91900),
            ("9.10", 91000),
            ("9.8.1", 90801),
            ("9.0", 90000),
            (" 10.2 ", 100200),
        ] {
            assert_eq!(
                text.parse::<CudnnVersion>().unwrap(),
                CudnnVersion(want),
                "{text}"
            );
        }
        assert_eq!(CudnnVersion(91900).to_string(), "9.19.0");
        for bad in [
            "", "9", "nine", "9.x", "9.19.0.1", "9.100", "9.-1", "9.+1", "9..1", "919",
        ] {
            let e = bad.parse::<CudnnVersion>().unwrap_err().to_string();
            assert!(
                e.contains("--cudnn-version") && e.contains("9.19, 9.19.0 or 91900"),
                "{bad}: {e}"
            );
        }
        let e = "8.9.7".parse::<CudnnVersion>().unwrap_err().to_string();
        assert!(
            e.contains("older than 9.0") && e.contains("--attn-kernel native"),
            "{e}"
        );
        assert!("89000".parse::<CudnnVersion>().is_err());
    }

    #[test]
    fn the_run_file_takes_a_string_or_cudnns_number_and_refuses_a_float() {
        #[derive(serde::Deserialize)]
        struct K {
            v: CudnnVersion,
        }
        let read = |t: &str| toml::from_str::<K>(t).map(|k| k.v);
        assert_eq!(read("v = \"9.10\"").unwrap(), CudnnVersion(91000));
        assert_eq!(read("v = 91900").unwrap(), CudnnVersion(91900));
        let e = read("v = 9.10").err().unwrap().to_string();
        assert!(e.contains("cannot tell 9.1 from 9.10"), "{e}");
        assert!(read("v = \"8.9\"").is_err());
    }
}
