//! Parquet inputs of `upipe tokenize`: one document per row, its text in
//! a string column (`--field`), read row group by row group (only that
//! column is decoded; snappy, gzip and zstd pages), a few rows at a time:
//! as many as hold about `--batch-mb` of text by the column's sizes in the
//! file's metadata (a read of 1,024 rows of 1 MiB each held 600 MiB).

use crate::error::{Error, Result};
use parquet::basic::{ConvertedType, LogicalType, Type as PhysicalType};
use parquet::file::metadata::ParquetMetaData;
use parquet::file::reader::{FileReader, SerializedFileReader};
use parquet::record::{Field, reader::RowIter};
use parquet::schema::types::Type;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The documents of one Parquet file.
pub struct ParquetDocs {
    path: PathBuf,
    field: String,
    rows: RowIter<'static>,
    /// 1-based number of the row read last.
    row: usize,
}

impl ParquetDocs {
    /// Opens `path` and checks that `field` is a text column, to be read in
    /// batches of about `batch_bytes` of text ([`rows_per_read`]).
    pub fn open(path: &Path, field: &str, batch_bytes: usize) -> Result<ParquetDocs> {
        let file = std::fs::File::open(path)
            .map_err(|e| Error::io(format!("opening {}", path.display()), e))?;
        let reader = SerializedFileReader::new(file).map_err(|e| {
            Error::Config(format!(
                "{}: not a readable Parquet file ({e}); check that the file is whole",
                path.display()
            ))
        })?;
        let schema = reader.metadata().file_metadata().schema();
        let fields = schema.get_fields();
        let Some(column) = fields.iter().find(|f| f.name() == field) else {
            let names: Vec<&str> = fields.iter().map(|f| f.name()).collect();
            return crate::config_err!(
                "{}: no column \"{field}\" (it has {}); name the text column with --field",
                path.display(),
                names.join(", ")
            );
        };
        if !is_text(column) {
            return crate::config_err!(
                "{}: column \"{field}\" is {}, not text (a UTF-8 string column); name the text \
                 column with --field",
                path.display(),
                describe(column)
            );
        }
        let rows_per_read = rows_per_read(reader.metadata(), field, batch_bytes);
        let projection = Type::group_type_builder("schema")
            .with_fields(vec![Arc::clone(column)])
            .build()
            .map_err(|e| parquet_err(path, e))?;
        let rows = RowIter::from_file_into(Box::new(reader))
            .project(Some(projection))
            .map_err(|e| parquet_err(path, e))?
            .with_batch_size(rows_per_read);
        Ok(ParquetDocs {
            path: path.to_path_buf(),
            field: field.to_string(),
            rows,
            row: 0,
        })
    }

    /// The next row's text, or `None` after the last.
    pub fn next_text(&mut self) -> Result<Option<String>> {
        let Some(row) = self.rows.next() else {
            return Ok(None);
        };
        self.row += 1;
        let row = row.map_err(|e| parquet_err(&self.path, e))?;
        match row.get_column_iter().next().map(|(_, f)| f) {
            Some(Field::Str(s)) => Ok(Some(s.clone())),
            _ => crate::config_err!(
                "{} row {}: column \"{}\" holds no text (null)",
                self.path.display(),
                self.row,
                self.field
            ),
        }
    }
}

/// Rows read at once: about `batch_bytes` of the column `field` at the
/// largest bytes per row of any row group (its decoded values, else its
/// uncompressed pages), between 1 and 1,024 (the reader's default).
pub fn rows_per_read(meta: &ParquetMetaData, field: &str, batch_bytes: usize) -> usize {
    let per_row = meta
        .row_groups()
        .iter()
        .filter_map(|rg| {
            let column = rg
                .columns()
                .iter()
                .find(|c| c.column_path().string() == field)?;
            let bytes = column
                .unencoded_byte_array_data_bytes()
                .unwrap_or(0)
                .max(column.uncompressed_size());
            let rows = rg.num_rows().max(1);
            Some((bytes.max(0) as u64).div_ceil(rows as u64))
        })
        .max()
        .unwrap_or(0);
    let rows = (batch_bytes as u64) / per_row.max(1);
    rows.clamp(1, MAX_ROWS_PER_READ as u64) as usize
}

/// The row reader's default batch, the most read at once.
const MAX_ROWS_PER_READ: usize = 1024;

/// Whether a column holds UTF-8 strings.
fn is_text(column: &Type) -> bool {
    if !column.is_primitive() || column.get_physical_type() != PhysicalType::BYTE_ARRAY {
        return false;
    }
    let info = column.get_basic_info();
    info.converted_type() == ConvertedType::UTF8
        || matches!(info.logical_type_ref(), Some(LogicalType::String))
}

/// A column's type, for messages.
fn describe(column: &Type) -> String {
    match column.is_primitive() {
        true => format!(
            "{} ({})",
            column.get_physical_type(),
            column.get_basic_info().converted_type()
        ),
        false => "a group of columns".to_string(),
    }
}

fn parquet_err(path: &Path, e: parquet::errors::ParquetError) -> Error {
    Error::Config(format!(
        "{}: reading Parquet failed ({e}); check that the file is whole",
        path.display()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use parquet::data_type::{ByteArray, ByteArrayType, Int32Type};
    use parquet::file::writer::SerializedFileWriter;
    use parquet::schema::parser::parse_message_type;

    /// A file of rows `(text, n)`, written with snappy pages.
    fn write(path: &Path, texts: &[&str]) {
        let schema = "message schema { REQUIRED BYTE_ARRAY text (UTF8); \
                      REQUIRED BYTE_ARRAY raw; REQUIRED INT32 n; }";
        let schema = Arc::new(parse_message_type(schema).unwrap());
        let props = parquet::file::properties::WriterProperties::builder()
            .set_compression(parquet::basic::Compression::SNAPPY)
            .build();
        let file = std::fs::File::create(path).unwrap();
        let mut w = SerializedFileWriter::new(file, schema, Arc::new(props)).unwrap();
        let mut group = w.next_row_group().unwrap();
        let strings: Vec<ByteArray> = texts.iter().map(|t| ByteArray::from(*t)).collect();
        for i in 0..3 {
            let mut col = group.next_column().unwrap().unwrap();
            match i {
                0 | 1 => col
                    .typed::<ByteArrayType>()
                    .write_batch(&strings, None, None),
                _ => col
                    .typed::<Int32Type>()
                    .write_batch(&vec![1; texts.len()], None, None),
            }
            .unwrap();
            col.close().unwrap();
        }
        group.close().unwrap();
        w.close().unwrap();
    }

    #[test]
    fn rows_of_a_text_column_are_documents_and_other_columns_are_refused() {
        let path = std::env::temp_dir().join(format!("upipe-pq-{}.parquet", std::process::id()));
        write(&path, &["first doc", "", "third — ü"]);
        let mut docs = ParquetDocs::open(&path, "text", 1 << 20).unwrap();
        let mut all = Vec::new();
        while let Some(t) = docs.next_text().unwrap() {
            all.push(t);
        }
        assert_eq!(all, ["first doc", "", "third — ü"]);
        let e = ParquetDocs::open(&path, "body", 1 << 20)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("no column \"body\"") && e.contains("text, raw, n") && e.contains("--field"),
            "{e}"
        );
        let e = ParquetDocs::open(&path, "n", 1 << 20)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("column \"n\" is INT32") && e.contains("not text"),
            "{e}"
        );
        let e = ParquetDocs::open(&path, "raw", 1 << 20)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("BYTE_ARRAY") && e.contains("not text"), "{e}");
        std::fs::write(&path, b"PAR1 not really").unwrap();
        let e = ParquetDocs::open(&path, "text", 1 << 20)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("not a readable Parquet file"), "{e}");
        std::fs::remove_file(&path).unwrap();
    }
}
