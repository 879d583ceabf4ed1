//! The run file `--print-config` prints (and every checkpoint stores as
//! `run.toml`): each key of the subcommand, by section, with its value, and
//! each key left unset (a flag without a default, such as `--min-lr`) as a
//! comment saying what it does, so the file lists every key there is.

use crate::cli::config::RunArgs;
use crate::error::{Error, Result};
use clap::{Args, Command};

/// `args` as an annotated run file: the keys of `keys` (`(flag id,
/// section, key)` tables of the subcommand and its flag groups) that hold a
/// value as TOML, the others commented with their flag's help.
pub fn annotated<A: RunArgs + Args>(args: &A, keys: &[&[(&str, &str, &str)]]) -> Result<String> {
    let set = toml::Table::try_from(args.to_file()).map_err(write_error)?;
    let cmd = A::augment_args(Command::new("upipe"));
    let mut out = String::new();
    // every section in the schema's order, each as the schema orders its keys
    let sections =
        toml::Table::try_from(crate::cli::config::RunFile::default()).map_err(write_error)?;
    for section in sections.keys() {
        let values = set.get(section).and_then(|v| v.as_table());
        let unset: Vec<(&str, &str)> = keys
            .iter()
            .flat_map(|k| k.iter())
            .filter(|(_, s, key)| {
                s == section && values.is_none_or(|t| !t.contains_key(&kebab(key)))
            })
            .map(|(id, _, key)| (*id, *key))
            .collect();
        let has_values = values.is_some_and(|t| !t.is_empty());
        if !has_values && unset.is_empty() {
            continue;
        }
        if !out.is_empty() {
            out.push('\n');
        }
        match values.filter(|t| !t.is_empty()) {
            Some(t) => {
                let mut one = toml::Table::new();
                one.insert(section.clone(), toml::Value::Table(t.clone()));
                out.push_str(&to_toml_table(&one)?);
            }
            None => out.push_str(&format!("[{section}]\n")),
        }
        for (id, key) in unset {
            out.push_str(&unset_comment(&kebab(key), &help_of(&cmd, id)));
        }
    }
    Ok(out)
}

/// The TOML of a table of one section.
fn to_toml_table(t: &toml::Table) -> Result<String> {
    toml::to_string(t).map_err(write_error)
}

fn write_error(e: impl std::fmt::Display) -> Error {
    Error::Config(format!("cannot write the run file: {e}"))
}

/// A key's name in the file.
fn kebab(key: &str) -> String {
    key.replace('_', "-")
}

/// The help of flag `id` on one line.
fn help_of(cmd: &Command, id: &str) -> String {
    let arg = cmd.get_arguments().find(|a| a.get_id().as_str() == id);
    let help = arg.and_then(|a| a.get_long_help().or(a.get_help()));
    let text = help.map(|h| h.to_string()).unwrap_or_default();
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// `# key = (unset) help`, wrapped at 78 columns.
fn unset_comment(key: &str, help: &str) -> String {
    let mut lines = vec![format!("# {key} = (unset)")];
    for word in help.split(' ').filter(|w| !w.is_empty()) {
        let last = lines.last_mut().expect("one line at least");
        if last.len() + 1 + word.len() > 78 {
            lines.push(format!("#   {word}"));
        } else {
            last.push(' ');
            last.push_str(word);
        }
    }
    lines.iter().map(|l| format!("{l}\n")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unset_keys_wrap_their_help_into_comments() {
        let help = "The learning rate the schedule ends at (default: --lr / 10). ".repeat(2);
        let text = unset_comment("min-lr", help.trim());
        let lines: Vec<&str> = text.lines().collect();
        assert!(
            lines[0].starts_with("# min-lr = (unset) The learning rate"),
            "{text}"
        );
        assert!(lines.len() == 2 && lines[1].starts_with("#   "), "{text}");
        assert!(lines.iter().all(|l| l.len() <= 78), "{text}");
        // what the comments say is not a key: the file reads back as none set
        assert_eq!(
            crate::cli::config::parse(&format!("[optim]\n{text}")).unwrap(),
            crate::cli::config::RunFile::default()
        );
    }
}
