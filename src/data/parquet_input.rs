//! Parquet inputs of `upipe tokenize`: one document per row, its text in
//! a string column (`--field`), read row group by row group (only that
//! column is decoded; snappy, gzip and zstd pages).

use crate::error::{Error, Result};
use parquet::basic::{ConvertedType, LogicalType, Type as PhysicalType};
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
    /// Opens `path` and checks that `field` is a text column.
    pub fn open(path: &Path, field: &str) -> Result<ParquetDocs> {
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
        let projection = Type::group_type_builder("schema")
            .with_fields(vec![Arc::clone(column)])
            .build()
            .map_err(|e| parquet_err(path, e))?;
        let rows = RowIter::from_file_into(Box::new(reader))
            .project(Some(projection))
            .map_err(|e| parquet_err(path, e))?;
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
        let mut docs = ParquetDocs::open(&path, "text").unwrap();
        let mut all = Vec::new();
        while let Some(t) = docs.next_text().unwrap() {
            all.push(t);
        }
        assert_eq!(all, ["first doc", "", "third — ü"]);
        let e = ParquetDocs::open(&path, "body").err().unwrap().to_string();
        assert!(
            e.contains("no column \"body\"") && e.contains("text, raw, n") && e.contains("--field"),
            "{e}"
        );
        let e = ParquetDocs::open(&path, "n").err().unwrap().to_string();
        assert!(
            e.contains("column \"n\" is INT32") && e.contains("not text"),
            "{e}"
        );
        let e = ParquetDocs::open(&path, "raw").err().unwrap().to_string();
        assert!(e.contains("BYTE_ARRAY") && e.contains("not text"), "{e}");
        std::fs::write(&path, b"PAR1 not really").unwrap();
        let e = ParquetDocs::open(&path, "text").err().unwrap().to_string();
        assert!(e.contains("not a readable Parquet file"), "{e}");
        std::fs::remove_file(&path).unwrap();
    }
}
